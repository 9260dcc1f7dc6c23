"""TraceRequest and Trace invariants, and TraceError's message formats."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contbatch.traces import Trace, TraceError, TraceRequest
from contbatch.traces.schema import RequestValueError


def _req(request_id: str = "A", arrival_ts: float = 0.0, **kwargs: object) -> TraceRequest:
    values: dict[str, object] = {"num_prompt_tokens": 1, "num_output_tokens": 1, **kwargs}
    return TraceRequest(request_id, arrival_ts, **values)  # type: ignore[arg-type]


def test_request_defaults_and_float_arrival() -> None:
    request = TraceRequest("A", 3, 4, 5)  # an int arrival is stored as a float
    assert request.arrival_ts == 3.0
    assert isinstance(request.arrival_ts, float)
    assert (request.priority, request.tenant, request.deadline_ts) == (0, None, None)


def test_request_is_frozen() -> None:
    request = _req()
    with pytest.raises(AttributeError):
        request.priority = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"request_id": ""}, "request_id", "non-empty string"),
        ({"request_id": 7}, "request_id", "non-empty string"),
        ({"arrival_ts": -1.0}, "arrival_ts", ">= 0"),
        ({"arrival_ts": math.inf}, "arrival_ts", "finite"),
        ({"arrival_ts": math.nan}, "arrival_ts", "finite"),
        ({"arrival_ts": True}, "arrival_ts", "number"),
        ({"arrival_ts": "1"}, "arrival_ts", "number"),
        ({"arrival_ts": 10**400}, "arrival_ts", "finite"),
        ({"num_prompt_tokens": 0}, "num_prompt_tokens", ">= 1"),
        ({"num_prompt_tokens": 3.5}, "num_prompt_tokens", "integer"),
        ({"num_prompt_tokens": 4.0}, "num_prompt_tokens", "integer"),
        ({"num_output_tokens": True}, "num_output_tokens", "integer"),
        ({"num_output_tokens": "5"}, "num_output_tokens", "integer"),
        ({"priority": 1.5}, "priority", "integer"),
        ({"tenant": ""}, "tenant", "non-empty string"),
        ({"tenant": 3}, "tenant", "non-empty string"),
        ({"arrival_ts": 2.0, "deadline_ts": 1.0}, "deadline_ts", ">= the arrival"),
        ({"deadline_ts": math.inf}, "deadline_ts", "finite"),
        ({"num_output_tokens": 5, "max_output_tokens": 4}, "max_output_tokens", ">= the output tokens (5)"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"max_output_tokens": 2.0}, "max_output_tokens", "integer"),
        ({"max_output_tokens": True}, "max_output_tokens", "integer"),
        ({"prefix_group": ""}, "prefix_group", "non-empty string"),
        ({"prefix_group": 1}, "prefix_group", "non-empty string"),
        ({"prefix_group": "g", "prefix_tokens": -1}, "prefix_tokens", ">= 0"),
        ({"prefix_group": "g", "prefix_tokens": 1.0}, "prefix_tokens", "integer"),
        ({"prefix_group": "g", "prefix_tokens": None}, "prefix_tokens", "integer"),
        ({"prefix_group": "g", "prefix_tokens": 2}, "prefix_tokens", "<= the prompt tokens (1)"),
        ({"prefix_tokens": 1}, "prefix_tokens", "0 without a prefix group"),
        ({"arrival_ts": 2.0, "cancel_ts": 1.5}, "cancel_ts", ">= the arrival"),
        ({"cancel_ts": math.nan}, "cancel_ts", "finite"),
        ({"cancel_ts": "3"}, "cancel_ts", "number"),
        ({"read_rate": 0.0}, "read_rate", "> 0"),
        ({"read_rate": -5}, "read_rate", "> 0"),
        ({"read_rate": math.inf}, "read_rate", "finite"),
        ({"read_rate": False}, "read_rate", "number"),
    ],
)
def test_request_rejects(kwargs: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(RequestValueError) as info:
        _req(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert fragment in info.value.problem
    assert isinstance(info.value, ValueError)


def test_request_accepts_edge_values() -> None:
    request = _req(arrival_ts=2.0, priority=-3, tenant="t", deadline_ts=2)
    assert request.deadline_ts == 2.0
    assert request.priority == -3


def test_new_fields_default_to_absent() -> None:
    request = TraceRequest("A", 0.0, 4, 5)
    assert (request.max_output_tokens, request.prefix_group, request.prefix_tokens) == (None, None, 0)
    assert (request.cancel_ts, request.read_rate) == (None, None)


def test_new_fields_accept_edge_values() -> None:
    request = _req(
        arrival_ts=2.0,
        num_prompt_tokens=3,
        num_output_tokens=5,
        max_output_tokens=5,
        prefix_group="sys",
        prefix_tokens=3,
        cancel_ts=2,
        read_rate=1,
    )
    assert (request.max_output_tokens, request.prefix_tokens) == (5, 3)
    assert request.cancel_ts == 2.0 and isinstance(request.cancel_ts, float)
    assert request.read_rate == 1.0 and isinstance(request.read_rate, float)
    assert _req(prefix_group="declared, no tokens").prefix_tokens == 0


def test_output_limit() -> None:
    assert _req(num_output_tokens=7).output_limit == 7
    assert _req(num_output_tokens=7, max_output_tokens=2048).output_limit == 2048


def test_trace_sorts_stably_by_arrival() -> None:
    requests = (_req("late", 5.0), _req("b", 1.0), _req("a", 1.0), _req("first", 0.0))
    trace = Trace(name="t", requests=requests, time_unit="s", source="test")
    assert [r.request_id for r in trace] == ["first", "b", "a", "late"]
    assert len(trace) == 4
    assert trace.duration == 5.0


def test_empty_trace_duration() -> None:
    assert Trace(name="t", requests=(), time_unit="tick", source="test").duration == 0.0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"time_unit": "ms"}, "time_unit"),
        ({"source": "two\nlines"}, "one line"),
        ({"requests": (_req("A"), _req("A", 1.0))}, "duplicate request id 'A'"),
    ],
)
def test_trace_rejects(kwargs: dict[str, object], fragment: str) -> None:
    values: dict[str, object] = {"name": "t", "requests": (), "time_unit": "s", "source": "x", **kwargs}
    with pytest.raises(ValueError, match=fragment):
        Trace(**values)  # type: ignore[arg-type]


def test_trace_error_formats() -> None:
    row = TraceError("must be >= 1", file="t.csv", line=3, field="prompt_tokens")
    assert str(row) == "t.csv:3: field 'prompt_tokens': must be >= 1"
    assert str(TraceError("invalid JSON", file="t.jsonl", line=2)) == "t.jsonl:2: invalid JSON"
    assert str(TraceError("empty file", file="t.jsonl")) == "t.jsonl: empty file"
    assert str(TraceError("unknown trace 'x'")) == "unknown trace 'x'"
    assert isinstance(row, ValueError)


_FIELD_VALUES = {  # each field: values that pass and values the schema refuses
    "request_id": ["r", "other", "", 3],
    "arrival_ts": [0.0, 2.5, 7, -1.0, math.inf, True],
    "num_prompt_tokens": [1, 40, 0, 2.0],
    "num_output_tokens": [1, 9, 50, 0],
    "priority": [0, -3, 1.5],
    "tenant": [None, "t", ""],
    "deadline_ts": [None, 3.0, 100.0, 1.0],
    "max_output_tokens": [None, 50, 5],
    "prefix_group": [None, "g", ""],
    "prefix_tokens": [0, 3, 60, -1],
    "cancel_ts": [None, 4.0, 0.5],
    "read_rate": [None, 2.0, 0.0],
}


@given(st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in _FIELD_VALUES.items()}))
def test_replace_is_dataclasses_replace(changes: dict[str, object]) -> None:
    base = TraceRequest("r", 2.0, 40, 9, deadline_ts=10.0, prefix_group="g", prefix_tokens=3, cancel_ts=6.0)
    try:
        expected: object = dataclasses.replace(base, **changes)  # type: ignore[arg-type]
    except RequestValueError as exc:
        expected = (exc.field, exc.problem)
    try:
        got: object = base.replace(**changes)
    except RequestValueError as exc:
        got = (exc.field, exc.problem)
    assert got == expected
    if isinstance(got, TraceRequest):
        assert [type(getattr(got, f.name)) for f in dataclasses.fields(got)] == [
            type(getattr(expected, f.name)) for f in dataclasses.fields(got)
        ]


def test_replace_names_an_unknown_field() -> None:
    with pytest.raises(TypeError, match="no field 'arrival'"):
        TraceRequest("r", 0.0, 1, 1).replace(arrival=1.0)
