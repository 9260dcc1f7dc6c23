"""Canonical JSONL: parsing, located errors, and the write/load round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.traces import Trace, TraceError, TraceRequest, load_jsonl, write_jsonl

from ._helpers import WriteFile, assert_located, trace_requests

GOOD = (
    '{"id": "A", "arrival": 0, "prompt_tokens": 4, "output_tokens": 5}\n'
    "\n"
    '{"id": "B", "arrival": 0.5, "prompt_tokens": 2, "output_tokens": 2, "priority": -1,'
    ' "tenant": "t1", "deadline": 7.25}\n'
    '{"id": "C", "arrival": 0.25, "prompt_tokens": 3, "output_tokens": 4, "tenant": null}\n'
)


def test_load_jsonl(write_file: WriteFile) -> None:
    path = write_file("work.jsonl", GOOD)
    trace = load_jsonl(path)
    assert (trace.name, trace.time_unit, trace.source) == ("work", "s", f"file {path}")
    assert [r.request_id for r in trace] == ["A", "C", "B"]  # sorted by arrival
    assert trace.requests[2] == TraceRequest("B", 0.5, 2, 2, priority=-1, tenant="t1", deadline_ts=7.25)
    assert trace.requests[1].tenant is None


def test_load_jsonl_options(write_file: WriteFile) -> None:
    whole = (
        GOOD.replace('"arrival": 0.5', '"arrival": 5').replace('"arrival": 0.25', '"arrival": 2').replace("7.25", "7")
    )
    path = write_file("work.jsonl", whole.replace("\n", "\r\n"))
    trace = load_jsonl(path, time_unit="tick", name="mine", source="made up")
    assert (trace.name, trace.time_unit, trace.source, len(trace)) == ("mine", "tick", "made up", 3)
    assert [r.arrival_ts for r in trace] == [0.0, 2.0, 5.0]


ROW = '"id": "A", "arrival": 1, "prompt_tokens": 4, "output_tokens": 5'


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        ('{"arrival": 1, "prompt_tokens": 4, "output_tokens": 5}', "id", "missing"),
        ('{"id": "A", "arrival": 1, "output_tokens": 5}', "prompt_tokens", "missing"),
        ('{"id": "A", "arrival": null, "prompt_tokens": 4, "output_tokens": 5}', "arrival", "missing"),
        ("{" + ROW.replace('"prompt_tokens": 4', '"prompt_tokens": 3.5') + "}", "prompt_tokens", "integer"),
        ("{" + ROW.replace('"prompt_tokens": 4', '"prompt_tokens": "4"') + "}", "prompt_tokens", "integer"),
        ("{" + ROW.replace('"output_tokens": 5', '"output_tokens": true') + "}", "output_tokens", "integer"),
        ("{" + ROW.replace('"output_tokens": 5', '"output_tokens": 0') + "}", "output_tokens", ">= 1"),
        ("{" + ROW.replace('"arrival": 1', '"arrival": -2') + "}", "arrival", ">= 0"),
        ("{" + ROW.replace('"arrival": 1', '"arrival": NaN') + "}", "arrival", "finite"),
        ("{" + ROW.replace('"id": "A"', '"id": 12') + "}", "id", "string"),
        ("{" + ROW.replace('"id": "A"', '"id": ""') + "}", "id", "non-empty"),
        ("{" + ROW + ', "deadline": 0.5}', "deadline", ">= the arrival"),
        ("{" + ROW + ', "priority": 0.5}', "priority", "integer"),
        ("{" + ROW + ', "tenant": 3}', "tenant", "string"),
        ("{" + ROW + ', "prompt_token": 3}', "prompt_token", "did you mean 'prompt_tokens'"),
        ("{" + ROW + ', "colour": "red"}', "colour", "unknown key"),
        ("{" + ROW + ', "id": "B"}', "id", "twice"),
        ("{" + ROW + ', "max_tokens": 4}', "max_tokens", ">= the output tokens (5)"),
        ("{" + ROW + ', "max_tokens": 4.5}', "max_tokens", "integer"),
        ("{" + ROW + ', "prefix_tokens": 2}', "prefix_tokens", "0 without a prefix group"),
        ("{" + ROW + ', "prefix_group": "g", "prefix_tokens": 5}', "prefix_tokens", "<= the prompt tokens (4)"),
        ("{" + ROW + ', "prefix_group": ""}', "prefix_group", "non-empty"),
        ("{" + ROW + ', "cancel_at": 0.5}', "cancel_at", ">= the arrival"),
        ("{" + ROW + ', "read_rate": 0}', "read_rate", "> 0"),
        ("{" + ROW + ', "read_rate": "fast"}', "read_rate", "number"),
        ("{" + ROW + ', "max_token": 9}', "max_token", "did you mean 'max_tokens'"),
    ],
)
def test_bad_row_names_file_line_field(write_file: WriteFile, line: str, field: str, fragment: str) -> None:
    good = '{"id": "first", "arrival": 0, "prompt_tokens": 1, "output_tokens": 1}\n'
    path = write_file("bad.jsonl", good + "\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        load_jsonl(path)
    assert_located(info.value, path, 3, field)
    assert fragment in info.value.problem


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"id": "A", "arrival": 0', "invalid JSON"),
        ("# a comment", "JSONL has no comments"),
        ("[1, 2]", "expected a JSON object, got list"),
    ],
)
def test_bad_json_names_file_and_line(write_file: WriteFile, line: str, fragment: str) -> None:
    path = write_file("bad.jsonl", line + "\n")
    with pytest.raises(TraceError) as info:
        load_jsonl(path)
    assert_located(info.value, path, 1, None)
    assert fragment in str(info.value)


def test_duplicate_id_names_both_lines(write_file: WriteFile) -> None:
    row = '{"id": "A", "arrival": 0, "prompt_tokens": 1, "output_tokens": 1}\n'
    other = '{"id": "B", "arrival": 0, "prompt_tokens": 1, "output_tokens": 1}\n'
    path = write_file("dup.jsonl", row + other + "\n" + row)
    with pytest.raises(TraceError) as info:
        load_jsonl(path)
    assert_located(info.value, path, None, None)
    assert "duplicate id 'A' on lines 1 and 4" in str(info.value)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file(write_file: WriteFile, text: str) -> None:
    path = write_file("empty.jsonl", text)
    with pytest.raises(TraceError, match="empty") as info:
        load_jsonl(path)
    assert_located(info.value, path, None, None)


def test_missing_file_and_bad_unit(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(TraceError, match="no such file") as info:
        load_jsonl(path)
    assert_located(info.value, path, None, None)
    with pytest.raises(TraceError, match="unknown time unit 'ms'"):
        load_jsonl(path, time_unit="ms")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"id": "\xe9"}\n')
    with pytest.raises(TraceError, match="not UTF-8"):
        load_jsonl(path)


def test_load_new_fields(write_file: WriteFile) -> None:
    line = "{" + ROW + ', "max_tokens": 64, "prefix_group": "sys", "prefix_tokens": 3, "cancel_at": 2.5,'
    line += ' "read_rate": 12}'
    request = load_jsonl(write_file("new.jsonl", line + "\n")).requests[0]
    assert request == TraceRequest(
        "A", 1.0, 4, 5, max_output_tokens=64, prefix_group="sys", prefix_tokens=3, cancel_ts=2.5, read_rate=12.0
    )
    assert request.output_limit == 64


def test_write_omits_defaults(tmp_path: Path) -> None:
    requests = (
        TraceRequest("A", 0.0, 4, 5),
        TraceRequest("B", 1.5, 2, 2, priority=2, tenant="t", deadline_ts=9.0),
        TraceRequest("C", 2.0, 4, 1, max_output_tokens=8, prefix_group="g", cancel_ts=2.25, read_rate=7.0),
        TraceRequest("D", 2.0, 4, 1, prefix_group="g", prefix_tokens=4),
    )
    path = tmp_path / "out.jsonl"
    write_jsonl(Trace(name="t", requests=requests, time_unit="s", source="test"), path)
    assert path.read_text(encoding="utf-8").splitlines() == [
        '{"id": "A", "arrival": 0, "prompt_tokens": 4, "output_tokens": 5}',
        '{"id": "B", "arrival": 1.5, "prompt_tokens": 2, "output_tokens": 2, "priority": 2,'
        ' "tenant": "t", "deadline": 9}',
        '{"id": "C", "arrival": 2, "prompt_tokens": 4, "output_tokens": 1, "max_tokens": 8, "prefix_group": "g",'
        ' "cancel_at": 2.25, "read_rate": 7}',
        '{"id": "D", "arrival": 2, "prompt_tokens": 4, "output_tokens": 1, "prefix_group": "g", "prefix_tokens": 4}',
    ]


def test_round_trip_through_file(write_file: WriteFile, tmp_path: Path) -> None:
    original = load_jsonl(write_file("in.jsonl", GOOD))
    write_jsonl(original, tmp_path / "out.jsonl")
    assert load_jsonl(tmp_path / "out.jsonl").requests == original.requests


_text = st.text(min_size=1, max_size=12)


@settings(max_examples=3 * settings().max_examples // 2, deadline=None)
@given(requests=st.lists(trace_requests(_text), min_size=1, max_size=20, unique_by=lambda r: r.request_id))
def test_write_load_round_trip(tmp_path_factory: pytest.TempPathFactory, requests: list[TraceRequest]) -> None:
    trace = Trace(name="random", requests=tuple(requests), time_unit="s", source="hypothesis")
    path = tmp_path_factory.mktemp("rt") / "random.jsonl"
    write_jsonl(trace, path)
    loaded = load_jsonl(path)
    assert loaded.requests == trace.requests
    for got, want in zip(loaded.requests, trace.requests, strict=True):
        assert got.arrival_ts.hex() == want.arrival_ts.hex()  # bit-exact, not merely equal
        assert repr(got) == repr(want)  # the other float fields too
