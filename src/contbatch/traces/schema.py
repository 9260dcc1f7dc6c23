"""The canonical trace schema: what one request of a workload is, and what a trace is.

This module owns the validation rules; every loader builds `TraceRequest`s through the
constructor, so a rule stated here holds for every trace whatever file it came from.

Invariants of a `TraceRequest` (checked in ``__post_init__``):
- ``request_id`` is a non-empty string;
- ``arrival_ts`` is a finite float >= 0 (offset from the trace start, in the trace's time unit);
- ``num_prompt_tokens`` and ``num_output_tokens`` are ints >= 1 (bools are not ints here);
- ``priority`` is an int (lower runs first); ``tenant`` is absent or a non-empty string;
- ``deadline_ts`` is absent or a finite float >= ``arrival_ts`` (same clock as the arrival);
- ``max_output_tokens`` is absent or an int >= ``num_output_tokens``: the client's output limit.
  The request really produces ``num_output_tokens`` (it stops early, like at an EOS token), but a
  scheduler that reserves conservatively must reserve for the limit (`output_limit`);
- ``prefix_group`` is absent or a non-empty string, ``prefix_tokens`` an int with
  0 <= ``prefix_tokens`` <= ``num_prompt_tokens``, and ``prefix_tokens`` > 0 needs a group. A
  group names one token sequence (a system prompt, a conversation so far) and each of its
  requests starts with that sequence's first ``prefix_tokens`` tokens, so two requests of a
  group share the shorter of their two prefixes;
- ``cancel_ts`` is absent or a finite float >= ``arrival_ts``: the client cancels at that time
  (absolute, same clock as the arrival) unless the request has finished by then;
- ``read_rate`` is absent (the client reads as fast as tokens come) or a finite float > 0: the
  tokens per time unit a streaming client consumes.

Invariants of a `Trace`: ``time_unit`` is one of `TIME_UNITS`; request ids are unique;
``requests`` is sorted by arrival, stably (the constructor sorts, so input order breaks ties);
``source`` is a single line.

Whole ticks: a tick clock advances in whole ticks, so in a trace whose ``time_unit`` is
``"tick"`` every time (``arrival_ts``, ``deadline_ts``, ``cancel_ts``: `TICK_TIME_FIELDS`) must be
a whole number (3 or 3.0, not 2.5). Every loader enforces it: a file loaded in ticks (row by row,
in `_common.assemble_trace`) or a built-in relabelled to ticks (`check_whole_ticks`) with a
fractional time is refused with a `TraceError` naming the request, the field (the file's own
name for it) and, for a file, the line. ``read_rate`` is a rate, not a time, and may be
fractional. Traces built in code are not checked at construction: a transformation such as
`synthetic.scale_to_rate` may rescale a tick trace to fractional times on purpose.

Programmatic misuse raises `RequestValueError` (a `ValueError` naming the attribute); loaders
turn it into a `TraceError` naming the file, the line and the file's own field name.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

TIME_UNITS: tuple[str, ...] = ("s", "tick")
TICK_TIME_FIELDS: tuple[str, ...] = ("arrival_ts", "deadline_ts", "cancel_ts")
"""The `TraceRequest` attributes that are times: whole numbers in a tick-clocked trace."""


class TraceError(ValueError):
    """A trace could not be loaded; the message always says where.

    Formats: ``"{file}:{line}: field '{field}': {problem}"`` for one field of one row,
    ``"{file}:{line}: {problem}"`` for a row that cannot be split into fields (bad JSON, extra
    CSV cells), ``"{file}: {problem}"`` for the file as a whole, and the bare problem when there
    is no file at all (an unknown trace name). Line numbers are 1-based.
    """

    def __init__(
        self, problem: str, *, file: str | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        self.problem = problem
        self.file = file
        self.line = line
        self.field = field
        super().__init__(_where(file, line, field) + problem)


def _where(file: str | None, line: int | None, field: str | None) -> str:
    parts = [] if file is None else [file if line is None else f"{file}:{line}"]
    if field is not None:
        parts.append(f"field '{field}'")
    return "".join(f"{part}: " for part in parts)


class RequestValueError(ValueError):
    """A `TraceRequest` attribute breaks a schema rule; ``field`` is the attribute name."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"field '{field}': {problem}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload: when it arrives and how much work it is."""

    request_id: str
    arrival_ts: float  # offset from the trace start, in the trace's time unit; finite, >= 0
    num_prompt_tokens: int  # >= 1
    num_output_tokens: int  # >= 1; the forced output length
    priority: int = 0  # lower runs first
    tenant: str | None = None  # absent or non-empty
    deadline_ts: float | None = None  # absolute, same clock as arrival_ts; >= arrival_ts
    max_output_tokens: int | None = None  # the client's limit; >= num_output_tokens
    prefix_group: str | None = None  # absent or non-empty; names a shared token sequence
    prefix_tokens: int = 0  # 0..num_prompt_tokens leading tokens from the group; > 0 needs a group
    cancel_ts: float | None = None  # absolute, same clock as arrival_ts; >= arrival_ts
    read_rate: float | None = None  # tokens per time unit the client reads; > 0; None: unlimited

    def __post_init__(self) -> None:
        if not self._is_plain():
            self._check_required()
        if self.tenant is not None:
            _check_text("tenant", self.tenant, optional=True)
        arrival_ts = self.arrival_ts
        if self.deadline_ts is not None:
            object.__setattr__(self, "deadline_ts", _checked_after("deadline_ts", self.deadline_ts, arrival_ts))
        self._check_output_limit()
        if self.prefix_group is not None or type(self.prefix_tokens) is not int or self.prefix_tokens != 0:
            self._check_prefix()  # (no group and no prefix tokens pass it)
        if self.cancel_ts is not None:
            object.__setattr__(self, "cancel_ts", _checked_after("cancel_ts", self.cancel_ts, arrival_ts))
        if self.read_rate is not None:
            read_rate = _checked_time("read_rate", self.read_rate)
            if read_rate <= 0:
                raise RequestValueError("read_rate", f"must be > 0 or absent, got {self.read_rate!r}")
            object.__setattr__(self, "read_rate", read_rate)

    def _is_plain(self) -> bool:
        """The common case, checked at a glance: the required fields pass `_check_required` as
        they are (a non-empty str id, a finite float arrival >= 0, int counts >= 1, an int
        priority), so it has nothing to check or convert. (Exact types: a subclass, an int
        arrival or a bool count takes the full check.)"""
        rid, arrival_ts = self.request_id, self.arrival_ts
        prompt, output = self.num_prompt_tokens, self.num_output_tokens
        return (
            type(rid) is str
            and rid != ""
            and type(arrival_ts) is float
            and 0.0 <= arrival_ts < math.inf
            and type(prompt) is int
            and prompt >= 1
            and type(output) is int
            and output >= 1
            and type(self.priority) is int
        )

    def _check_required(self) -> None:
        """Each required field against its rule (`RequestValueError` naming the first at fault);
        the arrival stored as a float."""
        _check_text("request_id", self.request_id, optional=False)
        arrival_ts = _checked_time("arrival_ts", self.arrival_ts)
        if arrival_ts < 0:
            raise RequestValueError("arrival_ts", f"must be >= 0, got {self.arrival_ts!r}")
        object.__setattr__(self, "arrival_ts", arrival_ts)
        _check_int("num_prompt_tokens", self.num_prompt_tokens, minimum=1)
        _check_int("num_output_tokens", self.num_output_tokens, minimum=1)
        _check_int("priority", self.priority, minimum=None)

    def replace(self, **changes: Any) -> TraceRequest:
        """``dataclasses.replace(self, **changes)``, checked the same way (the new request is
        built by the constructor), at about half its cost: loading and rescaling a trace move
        every request in time. TypeError for a name that is not a field."""
        values = list(_every_field(self))
        for name, value in changes.items():
            index = _FIELD_INDEX.get(name)
            if index is None:
                raise TypeError(f"TraceRequest has no field {name!r}")
            values[index] = value
        return TraceRequest(*values)

    @property
    def output_limit(self) -> int:
        """The most output tokens the client allows: what a conservative scheduler reserves for."""
        return self.num_output_tokens if self.max_output_tokens is None else self.max_output_tokens

    def _check_output_limit(self) -> None:
        if self.max_output_tokens is None:
            return
        _check_int("max_output_tokens", self.max_output_tokens, minimum=1)
        if self.max_output_tokens < self.num_output_tokens:
            problem = f"must be >= the output tokens ({self.num_output_tokens}) or absent, got {self.max_output_tokens}"
            raise RequestValueError("max_output_tokens", problem)

    def _check_prefix(self) -> None:
        _check_text("prefix_group", self.prefix_group, optional=True)
        _check_int("prefix_tokens", self.prefix_tokens, minimum=0)
        if self.prefix_tokens > self.num_prompt_tokens:
            problem = f"must be <= the prompt tokens ({self.num_prompt_tokens}), got {self.prefix_tokens}"
            raise RequestValueError("prefix_tokens", problem)
        if self.prefix_tokens > 0 and self.prefix_group is None:
            raise RequestValueError("prefix_tokens", f"must be 0 without a prefix group, got {self.prefix_tokens}")


_FIELD_INDEX = {f.name: i for i, f in enumerate(dataclasses.fields(TraceRequest))}
_every_field = operator.attrgetter(*_FIELD_INDEX)  # a request's fields, in constructor order


def _check_text(field: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        absent = " or absent" if optional else ""
        raise RequestValueError(field, f"must be a non-empty string{absent}, got {value!r}")


def _check_int(field: str, value: object, *, minimum: int | None) -> None:
    # bool is a subclass of int; a JSON `true` is not a token count.
    if not isinstance(value, int) or isinstance(value, bool):
        bound = "" if minimum is None else f" >= {minimum}"
        raise RequestValueError(field, f"must be an integer{bound}, got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestValueError(field, f"must be an integer >= {minimum}, got {value}")


def _checked_after(field: str, value: object, arrival_ts: float) -> float | None:
    """``value`` as a float time no earlier than the arrival, or None if absent."""
    if value is None:
        return None
    as_float = _checked_time(field, value)
    if as_float < arrival_ts:
        raise RequestValueError(field, f"must be >= the arrival ({arrival_ts!r}), got {value!r}")
    return as_float


def _checked_time(field: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RequestValueError(field, f"must be a number, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:
        raise RequestValueError(field, f"must be a finite number, got {value!r}") from None
    if not math.isfinite(as_float):
        raise RequestValueError(field, f"must be a finite number, got {value!r}")
    return as_float


@dataclass(frozen=True, slots=True)
class Trace:
    """A named, ordered workload: requests sorted by arrival, plus where it came from."""

    name: str
    requests: tuple[TraceRequest, ...]  # sorted by arrival_ts, stable; ids unique
    time_unit: str  # one of TIME_UNITS: "s" (seconds) or "tick" (abstract simulator steps)
    source: str  # one line of provenance / attribution

    def __post_init__(self) -> None:
        if self.time_unit not in TIME_UNITS:
            raise ValueError(f"time_unit must be one of {', '.join(TIME_UNITS)}, got {self.time_unit!r}")
        if "\n" in self.source or "\r" in self.source:
            raise ValueError(f"source must be one line, got {self.source!r}")
        requests = tuple(self.requests)
        if not all(map(isinstance, requests, itertools.repeat(TraceRequest))):
            wrong = next(r for r in requests if not isinstance(r, TraceRequest))
            raise TypeError(f"requests must be TraceRequest, got {type(wrong).__name__}")
        ids = list(map(operator.attrgetter("request_id"), requests))
        if len(set(ids)) != len(ids):  # (then find the first seen twice)
            seen: set[str] = set()
            for rid in ids:
                if rid in seen:
                    raise ValueError(f"duplicate request id {rid!r}")
                seen.add(rid)
        # sorted() is stable: requests arriving together keep their input order.
        object.__setattr__(self, "requests", tuple(sorted(requests, key=operator.attrgetter("arrival_ts"))))

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration(self) -> float:
        """Time from the trace start (0) to the last arrival, in ``time_unit``; 0.0 if empty."""
        return self.requests[-1].arrival_ts if self.requests else 0.0


def fractional_tick_time(request: TraceRequest) -> str | None:
    """The first of `TICK_TIME_FIELDS` whose value in `request` is not a whole number (the
    attribute name), or None when every time it has is whole, as a tick clock needs."""
    for field in TICK_TIME_FIELDS:
        value = getattr(request, field)
        if value is not None and not float(value).is_integer():
            return field
    return None


def tick_time_problem(request: TraceRequest, field: str) -> str:
    """The error text for a fractional `field` of `request` in a tick-clocked trace."""
    value = getattr(request, field)
    whole = "a trace in ticks needs integer times"
    return f"request {request.request_id!r}: {value!r} is not a whole number of ticks ({whole})"


def check_whole_ticks(trace: Trace, *, file: str | None = None) -> Trace:
    """`trace` itself when its clock is not ticks or every time in it is a whole number; else a
    `TraceError` naming the first offending request (in arrival order) and its field, and `file`
    when given. `load_trace` calls it on a built-in relabelled to ticks; the file loaders apply
    the same rule (`fractional_tick_time`) row by row, to name the line."""
    if trace.time_unit == "tick":
        for request in trace.requests:
            field = fractional_tick_time(request)
            if field is not None:
                raise TraceError(tick_time_problem(request, field), file=file, field=field)
    return trace
