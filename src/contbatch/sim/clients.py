"""The simulated clients: when each one cancels, and how fast each one reads its stream.

A client with a `read_rate` (tokens per clock unit, from the trace) reads its stream as a fluid:
between two looks at time t0 and t1 it takes min(generated, read + rate x (t1 - t0)) tokens;
one without a rate takes every token at once. What it takes is acknowledged to the scheduler
(`EngineCore.ack`), which is what frees output credits. A client whose `cancel_ts` has come cancels its
request: at that moment, tokens generated but not yet taken are wasted. That includes a
request that already finished while its slow client was still reading its tail (the scheduler
has forgotten it, so the clients count that waste themselves).

Invariant: a client never takes more tokens than were generated for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from contbatch.core.request import Request
from contbatch.loop import EngineCore
from contbatch.traces import TraceRequest

_EPS = 1e-9  # fluid reads land on whole tokens up to float error: 150.99999999999997 is 151


def _whole(tokens: float) -> int:
    return math.floor(tokens + _EPS)


class Clients:
    def __init__(self, specs: Sequence[TraceRequest], requests: Sequence[Request], *, track_reads: bool) -> None:
        self._requests = {r.request_id: r for r in requests}
        self._cancels = sorted(((s.cancel_ts, s.request_id) for s in specs if s.cancel_ts is not None), reverse=True)
        self._index = {s.request_id: i for i, s in enumerate(specs) if s.cancel_ts is not None}
        self._rates = {s.request_id: s.read_rate for s in specs if s.read_rate is not None}
        self._read: dict[str, float] = {}  # tokens taken so far, fluid (finite-rate readers)
        self._seen_ts: dict[str, float] = {}  # when each finite-rate reader last read
        self.track_reads = track_reads or bool(self._rates) or bool(self._cancels)
        self.late_waste = 0  # tokens of finished requests whose client cancelled before taking them
        self.max_buffered = 0  # most tokens generated but not yet taken by one client, at any look

    # -- cancellations ------------------------------------------------------------------------
    def next_cancel_ts(self) -> float | None:
        return self._cancels[-1][0] if self._cancels else None

    def cancel_due(self, core: EngineCore, until: float, num_added: int) -> None:
        """Cancel (at their own times) the requests whose cancel time is at or before `until`,
        among the first `num_added` of the trace (those already handed to the scheduler)."""
        kept: list[tuple[float, str]] = []
        while self._cancels and self._cancels[-1][0] <= until:
            ts, rid = self._cancels.pop()
            if self._index[rid] >= num_added:
                kept.append((ts, rid))
                continue
            request = self._requests[rid]
            if request.is_finished:
                self.late_waste += request.num_output_tokens - self.taken(request, ts)
            else:
                self.read(core, ts, only=request)
                core.abort(rid, at=ts)
            self._rates.pop(rid, None)
        # kept times are the smallest, popped in ascending order: put back, the list stays sorted
        self._cancels.extend(reversed(kept))

    # -- reading ------------------------------------------------------------------------------
    def _progress(self, request: Request, now: float) -> float:
        """Tokens the client of `request` has taken by `now` (fluid; unlimited readers take all)."""
        rate = self._rates.get(request.request_id)
        if rate is None:
            return float(request.num_output_tokens)
        rid = request.request_id
        last = self._seen_ts.get(rid)
        if last is None:  # starts reading when its first token exists
            last = request.timeline.first_token_ts or now
        return min(float(request.num_output_tokens), self._read.get(rid, 0.0) + rate * (now - last))

    def taken(self, request: Request, now: float) -> int:
        return _whole(self._progress(request, now))

    def read(self, core: EngineCore, now: float, *, only: Request | None = None) -> None:
        """Every client takes what it can by `now` and acknowledges it."""
        if not self.track_reads:
            return
        for request in (only,) if only is not None else list(core.scheduler.unfinished_requests()):
            if not request.num_output_tokens:
                continue
            rid = request.request_id
            read = self._progress(request, now)
            if rid in self._rates:
                self._read[rid], self._seen_ts[rid] = read, now
                self.max_buffered = max(self.max_buffered, request.num_output_tokens - _whole(read))
            core.ack(rid, _whole(read) - request.num_sent_tokens, at=now)

    def reads_slowly(self, requests: Sequence[Request]) -> bool:
        """Whether one of `requests` has a finite-rate client (its reads depend on every step)."""
        return bool(self._rates) and any(r.request_id in self._rates for r in requests)

    def next_read_ts(self, core: EngineCore) -> float | None:
        """When a slow client next takes one more token (which may give its request credits
        again, running or preempted)."""
        times = []
        for request in core.scheduler.unfinished_requests():
            rate = self._rates.get(request.request_id)
            if rate is None or not request.num_unsent_tokens:
                continue
            read = self._read.get(request.request_id, 0.0)
            last = self._seen_ts.get(request.request_id, request.timeline.first_token_ts)
            if last is not None:
                times.append(last + (_whole(read) + 1 - read) / rate)
        return min(times) if times else None
