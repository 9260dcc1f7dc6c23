"""Per-request timelines: the single record every metric is computed from.

A timeline is the event list ``ARRIVED, SCHEDULED*, PREEMPTED*, TOKENS(n)*, FINISHED(reason)``
of one request. It is stored column-wise (one list per event kind) because a run may hold
millions of token emissions; `events()` yields the same information as one ordered list.

Invariants (checked on every record call):
- timestamps never go backwards, and nothing is recorded after FINISHED;
- every TOKENS emission carries n >= 1 tokens;
- FINISHED is recorded exactly once, with exactly one reason.

Timestamps are in the clock of whoever produced the timeline (simulated ticks or seconds,
engine `time.monotonic()` seconds, or client wall seconds); the run states which.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from contbatch.core.status import FinishReason


class EventKind(enum.Enum):
    ARRIVED = "arrived"
    SCHEDULED = "scheduled"
    PREEMPTED = "preempted"
    TOKENS = "tokens"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    ts: float
    num_tokens: int = 0  # TOKENS only: tokens emitted at ts (>= 1)
    reason: FinishReason | None = None  # FINISHED only


class TimelineError(ValueError):
    """A record call would break a timeline invariant."""


@dataclass(slots=True, eq=False)
class Timeline:
    request_id: str
    arrival_ts: float
    num_prompt_tokens: int
    tenant: str | None = None
    priority: int = 0
    deadline_ts: float | None = None  # when the request should be finished by (same clock)
    scheduled_ts: list[float] = field(default_factory=list)  # every admission, re-admissions too
    preempted_ts: list[float] = field(default_factory=list)
    token_ts: list[float] = field(default_factory=list)  # one entry per emission
    token_counts: list[int] = field(default_factory=list)  # tokens per emission, parallel to token_ts
    finished_ts: float | None = None
    finish_reason: FinishReason | None = None
    _last_ts: float = field(default=float("-inf"), init=False, repr=False)  # (the arrival, once made)

    def __init__(  # noqa: PLR0917 (a dataclass's signature: its fields, in order)
        self,
        request_id: str,
        arrival_ts: float,
        num_prompt_tokens: int,
        tenant: str | None = None,
        priority: int = 0,
        deadline_ts: float | None = None,
        scheduled_ts: list[float] | None = None,
        preempted_ts: list[float] | None = None,
        token_ts: list[float] | None = None,
        token_counts: list[int] | None = None,
        finished_ts: float | None = None,
        finish_reason: FinishReason | None = None,
    ) -> None:
        """The fields in order, a list given as None made empty. Written out: compiled, a generated
        one runs as Python (`contbatch.compiled`)."""
        self.request_id = request_id
        self.arrival_ts = arrival_ts
        self.num_prompt_tokens = num_prompt_tokens
        self.tenant = tenant
        self.priority = priority
        self.deadline_ts = deadline_ts
        self.scheduled_ts = [] if scheduled_ts is None else scheduled_ts
        self.preempted_ts = [] if preempted_ts is None else preempted_ts
        self.token_ts = [] if token_ts is None else token_ts
        self.token_counts = [] if token_counts is None else token_counts
        self.finished_ts = finished_ts
        self.finish_reason = finish_reason
        self._last_ts = arrival_ts

    # -- recording -------------------------------------------------------------------------
    def _advance(self, ts: float) -> None:
        if self.finish_reason is not None:
            raise TimelineError(f"request {self.request_id!r}: event at {ts} after FINISHED")
        if ts < self._last_ts:
            raise TimelineError(f"request {self.request_id!r}: event at {ts} before previous event at {self._last_ts}")
        self._last_ts = ts

    def record_scheduled(self, ts: float) -> None:
        self._advance(ts)
        self.scheduled_ts.append(ts)

    def record_preempted(self, ts: float) -> None:
        self._advance(ts)
        self.preempted_ts.append(ts)

    def record_tokens(self, ts: float, num_tokens: int = 1) -> None:
        if num_tokens < 1:
            raise TimelineError(f"request {self.request_id!r}: a TOKENS event needs n >= 1, got {num_tokens}")
        if ts < self._last_ts or self.finish_reason is not None:
            self._advance(ts)  # raises
        self._last_ts = ts  # (the hot path: the checks of _advance, inlined)
        self.token_ts.append(ts)
        self.token_counts.append(num_tokens)

    def record_token_run(self, ts_list: list[float]) -> None:
        """One token at each of `ts_list` (non-decreasing): a run of decode steps at once."""
        if not ts_list:
            return
        if ts_list[0] < self._last_ts or self.finish_reason is not None:
            self._advance(ts_list[0])  # raises
        self._last_ts = ts_list[-1]
        self.token_ts.extend(ts_list)
        self.token_counts.extend([1] * len(ts_list))

    def record_finished(self, ts: float, reason: FinishReason) -> None:
        self._advance(ts)
        self.finished_ts = ts
        self.finish_reason = reason

    # -- reading ---------------------------------------------------------------------------
    @property
    def num_output_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def first_token_ts(self) -> float | None:
        return self.token_ts[0] if self.token_ts else None

    def events(self) -> Iterator[Event]:
        """All events in time order (ties: ARRIVED, SCHEDULED, PREEMPTED, TOKENS, FINISHED)."""
        rank = {kind: i for i, kind in enumerate(EventKind)}
        items: list[Event] = [Event(EventKind.ARRIVED, self.arrival_ts)]
        items += [Event(EventKind.SCHEDULED, ts) for ts in self.scheduled_ts]
        items += [Event(EventKind.PREEMPTED, ts) for ts in self.preempted_ts]
        items += [Event(EventKind.TOKENS, ts, n) for ts, n in zip(self.token_ts, self.token_counts, strict=True)]
        if self.finished_ts is not None:
            items.append(Event(EventKind.FINISHED, self.finished_ts, reason=self.finish_reason))
        items.sort(key=lambda e: (e.ts, rank[e.kind]))
        yield from items
