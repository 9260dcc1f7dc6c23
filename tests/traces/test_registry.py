"""load_trace: built-ins, dispatch by extension and CSV header, and its errors."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import pytest

from contbatch.traces import Trace, TraceError, TraceRequest, builtin_trace_names, load_trace

from ._helpers import WriteFile, assert_located

# the project's shared folder sits beside the repository (checked only where it is present)
SHARED_CSV = Path(__file__).resolve().parents[3] / "shared" / "data" / "AzureLLMInferenceTrace_code_2023.csv"


def test_builtin_names() -> None:
    assert builtin_trace_names() == (
        "seed",
        "azure-code",
        "seed-scaled",
        "kv-pressure",
        "long-prompt",
        "multi-tenant",
        "priority-mix",
        "deadlines",
        "cancel-storm",
        "slow-readers",
        "prefix-share",
    )


def test_seed_trace() -> None:
    trace = load_trace("seed")
    assert trace.requests == (
        TraceRequest("A", 0.0, 4, 5),
        TraceRequest("B", 0.0, 2, 2),
        TraceRequest("C", 3.0, 3, 4),
    )
    assert (trace.name, trace.time_unit, len(trace), trace.duration) == ("seed", "tick", 3, 3.0)
    assert "worked example" in trace.source


def test_azure_code_trace() -> None:
    trace = load_trace("azure-code")
    assert len(trace) == 8819
    assert (trace.name, trace.time_unit) == ("azure-code", "s")
    assert "CC-BY 4.0" in trace.source
    assert "Splitwise" in trace.source
    arrivals = [r.arrival_ts for r in trace]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert trace.duration == pytest.approx(3436, abs=1)
    assert trace.duration == 3435.948056  # 19:14:19.9280160 - 18:17:03.9799600
    assert trace.requests[0] == TraceRequest("azure-0", 0.0, 4808, 10)
    assert [r.request_id for r in trace] == [f"azure-{i}" for i in range(8819)]  # file is time-sorted
    assert load_trace("azure-code") is trace  # cached: parsed once


def test_shipped_data_is_byte_identical() -> None:
    shipped = resources.files("contbatch.traces").joinpath("data", "AzureLLMInferenceTrace_code_2023.csv")
    readme = resources.files("contbatch.traces").joinpath("data", "README.md").read_text(encoding="utf-8")
    assert "CC-BY 4.0" in readme
    assert "Splitwise" in readme
    if SHARED_CSV.exists():
        want = hashlib.sha256(SHARED_CSV.read_bytes()).hexdigest()
        assert hashlib.sha256(shipped.read_bytes()).hexdigest() == want


def test_time_unit_override() -> None:
    assert load_trace("seed", time_unit="s").time_unit == "s"
    assert load_trace("seed", time_unit="tick").time_unit == "tick"
    with pytest.raises(TraceError, match="unknown time unit 'ms'"):
        load_trace("seed", time_unit="ms")


def test_dispatch_jsonl_and_csv(write_file: WriteFile) -> None:
    jsonl = write_file("a.JSONL", '{"id": "x", "arrival": 1, "prompt_tokens": 2, "output_tokens": 3}\n')
    canonical = write_file("b.csv", "id,arrival,prompt_tokens,output_tokens\nx,1,2,3\n")
    azure = write_file("c.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,2,3\n")
    assert load_trace(str(jsonl)).requests == (TraceRequest("x", 1.0, 2, 3),)
    assert load_trace(canonical, time_unit="tick").requests == (TraceRequest("x", 1.0, 2, 3),)
    assert load_trace(str(canonical), time_unit="tick").time_unit == "tick"
    imported = load_trace(str(azure))
    assert imported.requests == (TraceRequest("azure-0", 0.0, 2, 3),)
    assert (imported.name, imported.time_unit) == ("c", "s")


def test_unknown_name() -> None:
    with pytest.raises(TraceError) as info:
        load_trace("nope")
    message = str(info.value)
    assert message.startswith("unknown trace 'nope': not a built-in (seed, azure-code, seed-scaled, kv-pressure, ")
    assert message.endswith(", prefix-share) and no such file")


def test_missing_path_is_unknown(tmp_path: Path) -> None:
    path = tmp_path / "missing.jsonl"
    with pytest.raises(TraceError, match="no such file") as info:
        load_trace(str(path))
    assert "missing.jsonl" in str(info.value)


@pytest.mark.parametrize("name", ["trace.txt", "trace"])
def test_unknown_extension(write_file: WriteFile, name: str) -> None:
    path = write_file(name, "id,arrival\n")
    with pytest.raises(TraceError, match="unknown trace format") as info:
        load_trace(str(path))
    assert_located(info.value, path, None, None)


def test_unknown_csv_header_lists_expected(write_file: WriteFile) -> None:
    path = write_file("odd.csv", "when,size\n1,2\n")
    with pytest.raises(TraceError) as info:
        load_trace(str(path))
    assert_located(info.value, path, None, None)
    assert "id,arrival,prompt_tokens,output_tokens" in str(info.value)
    assert "TIMESTAMP,ContextTokens,GeneratedTokens" in str(info.value)


def test_canonical_csv_with_typo_column_is_reported(write_file: WriteFile) -> None:
    path = write_file("typo.csv", "id,arrival,prompt_tokens,output_token\n")
    with pytest.raises(TraceError) as info:
        load_trace(str(path))
    assert_located(info.value, path, 1, "output_token")


@pytest.mark.parametrize("name", ["empty.csv", "empty.jsonl"])
def test_empty_files(write_file: WriteFile, name: str) -> None:
    path = write_file(name, "")
    with pytest.raises(TraceError, match="empty") as info:
        load_trace(str(path))
    assert_located(info.value, path, None, None)


def test_directory_is_not_a_trace(tmp_path: Path) -> None:
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    with pytest.raises(TraceError, match="directory"):
        load_trace(str(folder))


def test_builtins_are_traces() -> None:
    for name in builtin_trace_names():
        assert isinstance(load_trace(name), Trace)
