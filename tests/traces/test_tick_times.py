"""Issue 14: non-integer arrivals in a tick-clocked trace were accepted silently.

A tick clock advances in whole ticks: loaded in ticks, a trace whose arrival, deadline or cancel
time is fractional is refused with a `TraceError` (a `ValueError`) naming the file, the line,
the file's own field name and the request. The same file loads in seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.traces import (
    Trace,
    TraceError,
    TraceRequest,
    import_azure_csv,
    import_vidur_csv,
    load_csv,
    load_jsonl,
    load_trace,
)
from contbatch.traces.schema import check_whole_ticks, fractional_tick_time

from ._helpers import WriteFile, assert_located

FIRST = '{"id": "A", "arrival": 0, "prompt_tokens": 4, "output_tokens": 5}\n'


def _jsonl(write_file: WriteFile, second: str) -> Path:
    return write_file("t.jsonl", FIRST + second + "\n")


@pytest.mark.parametrize(
    ("second", "field", "value"),
    [
        ('{"id": "B", "arrival": 2.5, "prompt_tokens": 2, "output_tokens": 2}', "arrival", "2.5"),
        ('{"id": "B", "arrival": 2, "prompt_tokens": 2, "output_tokens": 2, "deadline": 7.25}', "deadline", "7.25"),
        ('{"id": "B", "arrival": 2, "prompt_tokens": 2, "output_tokens": 2, "cancel_at": 3.5}', "cancel_at", "3.5"),
    ],
)
def test_a_fractional_time_in_ticks_is_refused(write_file: WriteFile, second: str, field: str, value: str) -> None:
    path = _jsonl(write_file, second)
    with pytest.raises(TraceError) as info:
        load_jsonl(path, time_unit="tick")
    assert isinstance(info.value, ValueError)
    assert_located(info.value, path, 2, field)
    assert "request 'B'" in str(info.value) and value in str(info.value) and "whole number of ticks" in str(info.value)
    assert "\n" not in str(info.value)
    assert len(load_jsonl(path, time_unit="s")) == 2  # in seconds the same file is fine


def test_whole_numbers_and_fractional_read_rates_are_fine_in_ticks(write_file: WriteFile) -> None:
    second = '{"id": "B", "arrival": 3.0, "prompt_tokens": 2, "output_tokens": 2, "deadline": 9, "read_rate": 0.5}'
    trace = load_jsonl(_jsonl(write_file, second), time_unit="tick")
    assert [(r.arrival_ts, r.deadline_ts, r.read_rate) for r in trace] == [(0.0, None, None), (3.0, 9.0, 0.5)]


def test_every_loader_refuses_under_its_own_field_name(write_file: WriteFile) -> None:
    canonical = write_file("t.csv", "id,arrival,prompt_tokens,output_tokens\nA,0,4,5\nB,0.5,2,2\n")
    with pytest.raises(TraceError) as info:
        load_csv(canonical, time_unit="tick")
    assert_located(info.value, canonical, 3, "arrival")
    vidur = write_file("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,4,5\n1.5,2,2\n")
    with pytest.raises(TraceError) as info:
        import_vidur_csv(vidur, time_unit="tick")
    assert_located(info.value, vidur, 3, "arrived_at")
    assert "request 'vidur-1'" in str(info.value)
    azure = write_file(
        "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,4,5\n2023-11-16 18:17:04.5,2,2\n"
    )
    with pytest.raises(TraceError) as info:
        import_azure_csv(azure, time_unit="tick")
    assert_located(info.value, azure, 3, "TIMESTAMP")
    for path in (canonical, vidur, azure):  # sniffed by load_trace too
        with pytest.raises(TraceError, match="whole number of ticks"):
            load_trace(str(path), time_unit="tick")
        assert len(load_trace(str(path))) == 2


def test_a_builtin_relabelled_to_ticks_must_have_whole_times() -> None:
    with pytest.raises(TraceError, match=r"kv-pressure: field 'arrival_ts': request '.+': .* whole number of ticks"):
        load_trace("kv-pressure", time_unit="tick")
    assert load_trace("seed", time_unit="tick").time_unit == "tick"


def test_the_rule_on_traces_built_in_code() -> None:
    good = TraceRequest("a", 2.0, 1, 1, cancel_ts=4.0)
    late = TraceRequest("b", 3.0, 1, 1, deadline_ts=5.5)
    assert fractional_tick_time(good) is None and fractional_tick_time(late) == "deadline_ts"
    trace = Trace(name="t", requests=(good, late), time_unit="tick", source="test")
    with pytest.raises(TraceError, match=r"^field 'deadline_ts': request 'b': 5.5 is not a whole number of ticks"):
        check_whole_ticks(trace)
    seconds = Trace(name="t", requests=(good, late), time_unit="s", source="test")
    assert check_whole_ticks(seconds) is seconds


def test_the_cli_prints_one_clear_line_and_exits_2(write_file: WriteFile) -> None:
    path = _jsonl(write_file, '{"id": "B", "arrival": 2.5, "prompt_tokens": 2, "output_tokens": 2}')
    proc = subprocess.run(
        [sys.executable, "-m", "contbatch.cli.main", "simulate", "--trace", str(path), "--cost", "unit:8"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("contbatch simulate: error: --trace: ")
    assert f"{path}:2: field 'arrival': request 'B': 2.5 is not a whole number of ticks" in line
