"""Canonical CSV: columns, optional cells, default ids, located errors, round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.traces import Trace, TraceError, TraceRequest, load_csv, load_jsonl, write_csv, write_jsonl

from ._helpers import WriteFile, assert_located, trace_requests


def test_load_csv_with_optional_columns(write_file: WriteFile) -> None:
    text = (
        "id, arrival,prompt_tokens,output_tokens,priority,tenant,deadline\r\n"
        "A,0,4,5,,,\r\n"
        "B, 1.5 ,2,2,-1,t1,9e0\r\n"
        "\r\n"
        '"C,quoted",0.25,3,4,2,,\r\n'
    )
    trace = load_csv(write_file("work.csv", text))
    assert [r.request_id for r in trace] == ["A", "C,quoted", "B"]
    assert trace.requests[0] == TraceRequest("A", 0.0, 4, 5)
    assert trace.requests[2] == TraceRequest("B", 1.5, 2, 2, priority=-1, tenant="t1", deadline_ts=9.0)
    assert (trace.name, trace.time_unit) == ("work", "s")


def test_ids_default_to_row_index(write_file: WriteFile) -> None:
    text = "output_tokens,prompt_tokens,arrival\n5,4,3\n\n2,2,0\n"
    trace = load_csv(write_file("noid.csv", text), time_unit="tick")
    assert trace.requests == (TraceRequest("1", 0.0, 2, 2), TraceRequest("0", 3.0, 4, 5))
    assert trace.time_unit == "tick"


def test_load_csv_new_columns(write_file: WriteFile) -> None:
    text = (
        "id,arrival,prompt_tokens,output_tokens,max_tokens,prefix_group,prefix_tokens,cancel_at,read_rate\n"
        "A,0,4,5,,,,,\n"
        "B,1,4,5,2048,sys-0,3,1.5,12.5\n"
        "C,2,4,5,,sys-0,,,\n"
    )
    a, b, c = load_csv(write_file("new.csv", text)).requests
    assert a == TraceRequest("A", 0.0, 4, 5)
    assert b == TraceRequest(
        "B", 1.0, 4, 5, max_output_tokens=2048, prefix_group="sys-0", prefix_tokens=3, cancel_ts=1.5, read_rate=12.5
    )
    assert (c.prefix_group, c.prefix_tokens) == ("sys-0", 0)


HEADER = "id,arrival,prompt_tokens,output_tokens,deadline"
NEW_HEADER = "id,arrival,prompt_tokens,output_tokens,max_tokens,prefix_group,prefix_tokens,cancel_at,read_rate"


@pytest.mark.parametrize(
    ("row", "field", "fragment"),
    [
        ("B,1,2,3,2,,,,", "max_tokens", ">= the output tokens (3)"),
        ("B,1,2,3,4.0,,,,", "max_tokens", "integer"),
        ("B,1,2,3,,g,3,,", "prefix_tokens", "<= the prompt tokens (2)"),
        ("B,1,2,3,,,1,,", "prefix_tokens", "0 without a prefix group"),
        ("B,1,2,3,,g,-1,,", "prefix_tokens", ">= 0"),
        ("B,1,2,3,,,,0.5,", "cancel_at", ">= the arrival"),
        ("B,1,2,3,,,,inf,", "cancel_at", "number"),
        ("B,1,2,3,,,,,0", "read_rate", "> 0"),
        ("B,1,2,3,,,,,fast", "read_rate", "number"),
    ],
)
def test_bad_new_column_names_file_line_field(write_file: WriteFile, row: str, field: str, fragment: str) -> None:
    path = write_file("bad.csv", f"{NEW_HEADER}\nA,0,1,1,,,,,\n{row}\n")
    with pytest.raises(TraceError) as info:
        load_csv(path)
    assert_located(info.value, path, 3, field)
    assert fragment in info.value.problem


@pytest.mark.parametrize(
    ("row", "field", "fragment"),
    [
        ("B,1,2,3,x,", None, "row has 6 cells"),
        ("B,1,2", "output_tokens", "missing cell"),
        (",1,2,3,", "id", "missing required value"),
        ("B,,2,3,", "arrival", "missing required value"),
        ("B,1,3.5,3,", "prompt_tokens", "integer >= 1, got '3.5'"),
        ("B,1,two,3,", "prompt_tokens", "integer"),
        ("B,1,1_000,3,", "prompt_tokens", "integer"),
        ("B,1,2,0,", "output_tokens", ">= 1"),
        ("B,-1,2,3,", "arrival", ">= 0"),
        ("B,nan,2,3,", "arrival", "number"),
        ("B,1e999,2,3,", "arrival", "finite"),
        ("B,5,2,3,4", "deadline", ">= the arrival"),
    ],
)
def test_bad_row_names_file_line_field(write_file: WriteFile, row: str, field: str | None, fragment: str) -> None:
    path = write_file("bad.csv", f"{HEADER}\nA,0,1,1,\n{row}\n")
    with pytest.raises(TraceError) as info:
        load_csv(path)
    assert_located(info.value, path, 3, field)
    assert fragment in info.value.problem


@pytest.mark.parametrize(
    ("header", "field", "fragment"),
    [
        ("id,arrival,prompt_tokens", "output_tokens", "missing required column"),
        ("id,arrival,prompt_tokens,output_tokens,colour", "colour", "unknown column"),
        ("id,arrival,arrival,prompt_tokens,output_tokens", "arrival", "twice"),
    ],
)
def test_bad_header(write_file: WriteFile, header: str, field: str, fragment: str) -> None:
    path = write_file("head.csv", header + "\n")
    with pytest.raises(TraceError) as info:
        load_csv(path)
    assert_located(info.value, path, 1, field)
    assert fragment in info.value.problem


def test_duplicate_id(write_file: WriteFile) -> None:
    path = write_file("dup.csv", "id,arrival,prompt_tokens,output_tokens\nA,0,1,1\nB,0,1,1\nA,1,1,1\n")
    with pytest.raises(TraceError, match="duplicate id 'A' on lines 2 and 4") as info:
        load_csv(path)
    assert_located(info.value, path, None, None)


@pytest.mark.parametrize(("text", "fragment"), [("", "empty file"), ("arrival,prompt_tokens,output_tokens\n", "empty")])
def test_empty(write_file: WriteFile, text: str, fragment: str) -> None:
    path = write_file("empty.csv", text)
    with pytest.raises(TraceError, match=fragment) as info:
        load_csv(path)
    assert_located(info.value, path, None, None)


def _to_csv(trace: Trace) -> str:
    lines = ["id,arrival,prompt_tokens,output_tokens,priority,tenant,deadline"]
    for r in trace:
        deadline = "" if r.deadline_ts is None else repr(r.deadline_ts)
        cells = [r.request_id, repr(r.arrival_ts), str(r.num_prompt_tokens), str(r.num_output_tokens)]
        lines.append(",".join([*cells, str(r.priority), r.tenant or "", deadline]))
    return "\n".join(lines) + "\n"


def test_csv_round_trip(write_file: WriteFile, tmp_path: Path) -> None:
    requests = (
        TraceRequest("A", 0.1, 4, 5, tenant="t"),
        TraceRequest("B", 1 / 3, 2, 2, priority=7, deadline_ts=2 / 3),
        TraceRequest("C", 1e-7, 3, 4),
    )
    trace = Trace(name="rt", requests=requests, time_unit="s", source="test")
    from_csv = load_csv(write_file("rt.csv", _to_csv(trace)))
    assert from_csv.requests == trace.requests
    write_jsonl(from_csv, tmp_path / "rt.jsonl")
    assert load_jsonl(tmp_path / "rt.jsonl").requests == trace.requests


def test_write_csv_writes_used_columns_only(tmp_path: Path) -> None:
    requests = (
        TraceRequest("A", 0.0, 4, 5),
        TraceRequest("B,quoted", 1.5, 2, 2, tenant="t", cancel_ts=2.0),
    )
    path = tmp_path / "out.csv"
    write_csv(Trace(name="t", requests=requests, time_unit="s", source="test"), path)
    assert path.read_bytes().decode("utf-8") == (
        'id,arrival,prompt_tokens,output_tokens,tenant,cancel_at\r\nA,0,4,5,,\r\n"B,quoted",1.5,2,2,t,2\r\n'
    )
    assert load_csv(path).requests == requests


@pytest.mark.parametrize(("field", "value"), [("request_id", " A"), ("tenant", "t "), ("prefix_group", "\tg")])
def test_write_csv_refuses_blanks_it_cannot_keep(tmp_path: Path, field: str, value: str) -> None:
    request = dataclasses.replace(TraceRequest("A", 0.0, 1, 1), **{field: value})  # type: ignore[arg-type]
    trace = Trace(name="t", requests=(request,), time_unit="s", source="test")
    with pytest.raises(ValueError, match="surrounding blanks"):
        write_csv(trace, tmp_path / "out.csv")


_csv_text = st.text(min_size=1, max_size=12).filter(lambda text: text == text.strip())


@settings(max_examples=3 * settings().max_examples // 2, deadline=None)
@given(requests=st.lists(trace_requests(_csv_text), min_size=1, max_size=20, unique_by=lambda r: r.request_id))
def test_write_csv_load_round_trip(tmp_path_factory: pytest.TempPathFactory, requests: list[TraceRequest]) -> None:
    trace = Trace(name="random", requests=tuple(requests), time_unit="s", source="hypothesis")
    path = tmp_path_factory.mktemp("rt") / "random.csv"
    write_csv(trace, path)
    loaded = load_csv(path)
    assert loaded.requests == trace.requests
    assert [repr(r) for r in loaded] == [repr(r) for r in trace]  # floats bit-exact
