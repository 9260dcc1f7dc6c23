"""Assertions and hypothesis strategies shared by the trace tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypothesis import strategies as st

from contbatch.traces import TraceError, TraceRequest

WriteFile = Callable[[str, str], Path]


def assert_located(exc: TraceError, path: Path, line: int | None, field: str | None) -> None:
    """The message names the file, the line and the field, and the attributes agree."""
    message = str(exc)
    assert path.name in message
    assert exc.file == str(path)
    assert exc.line == line
    assert exc.field == field
    if line is not None:
        assert f"{path}:{line}: " in message
    if field is not None:
        assert f"field '{field}': " in message


_times = st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)
_rates = st.floats(min_value=0.0, max_value=1e12, exclude_min=True, allow_nan=False, allow_infinity=False)


@st.composite
def trace_requests(draw: st.DrawFn, text: st.SearchStrategy[str]) -> TraceRequest:
    """Any valid request, every optional field present or absent; ``text`` for ids and names."""
    arrival_ts = draw(st.one_of(_times, st.integers(0, 10**6).map(float)))
    deadline_slack, cancel_after = draw(st.none() | _times), draw(st.none() | _times)
    num_prompt_tokens, num_output_tokens = draw(st.integers(1, 10**9)), draw(st.integers(1, 10**9))
    prefix_group = draw(st.none() | text)
    return TraceRequest(
        request_id=draw(text),
        arrival_ts=arrival_ts,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        priority=draw(st.integers(-(10**9), 10**9)),
        tenant=draw(st.none() | text),
        deadline_ts=None if deadline_slack is None else arrival_ts + deadline_slack,
        max_output_tokens=draw(st.none() | st.integers(num_output_tokens, 10**9)),
        prefix_group=prefix_group,
        prefix_tokens=0 if prefix_group is None else draw(st.integers(0, num_prompt_tokens)),
        cancel_ts=None if cancel_after is None else arrival_ts + cancel_after,
        read_rate=draw(st.none() | _rates),
    )
