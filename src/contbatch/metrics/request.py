"""Per-request latency metrics: one `RequestMetrics` per finished `Timeline`.

This module owns the per-request definitions; each is written beside its subtraction. All
durations are in the clock of the timeline (seconds or ticks); no unit conversion happens here.

- queue time   = first SCHEDULED − ARRIVED; None if the request was never scheduled (rejected,
  cancelled while waiting, or a client-side timeline that cannot see scheduling).
- requeue time = Σ over preemptions k of (SCHEDULED[k+1] − PREEMPTED[k]); a preemption that is
  never followed by a re-admission (the request finished while waiting) counts up to FINISHED.
  It is reported separately from queue time and is 0 for a request never preempted.
- TTFT         = first TOKENS − ARRIVED; None if no token was ever emitted.
- TPOT         = (last TOKENS − first TOKENS) / (output tokens − 1); None with fewer than two
  output tokens. Tokens of one emission share its timestamp, so a single 3-token emission has
  TPOT 0.
- ITL          = gaps between consecutive emissions. Per emission: one sample per gap. Per token:
  each gap divided by the tokens of the later emission, repeated once per such token (a
  3-token speculative emission 0.3 after the previous one gives 0.1, 0.1, 0.1).
- E2E          = FINISHED − ARRIVED.

Which requests a latency statistic covers (the one rule, `RequestMetrics.ran`): a request *ran*
when it was scheduled at least once or emitted a token, and was not rejected. Every latency
statistic (queue time, requeue time, TTFT, TPOT, ITL and E2E, in `summary`, `groups`,
`streaming` and the CDF plots) is over the requests that ran, each over those of them for which
the latency is defined. A request that did not run (rejected at admission, or cancelled or timed
out before it was ever scheduled) has no latency: it is counted in ``finish_reasons``,
``num_rejected`` and ``num_not_run`` instead, and is a miss for goodput and SLO attainment. Its
per-request row still reports ``e2e`` (FINISHED − ARRIVED, e.g. 0 for an instant rejection).
Scheduler-side timelines are rejected only before their first admission, so there the rule is
"scheduled at least once". A client-side timeline (`contbatch.bench`) records the send as its
SCHEDULED event and cannot see the server's queue: there a request ran when it was sent and not
refused (HTTP 429 = rejected).

Invariants checked here (a `ValueError` names the request otherwise): the request finished
(FINISHED with a reason), every timestamp is finite, `token_ts` and `token_counts` are parallel,
and admissions pair with preemptions as the state machine allows
(len(preempted) <= len(scheduled) <= len(preempted) + 1).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline

SUCCESS_REASONS: frozenset[FinishReason] = frozenset({FinishReason.LENGTH, FinishReason.STOP})
"""Finish reasons that count as a completed request; every other reason is a failure."""


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Latencies of one finished request, in the clock unit of its timeline."""

    request_id: str
    tenant: str | None
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int  # every token emitted, delivered or not
    num_emissions: int  # TOKENS events; > num_output_tokens never, < with speculative decoding
    num_preemptions: int
    arrival_ts: float
    first_scheduled_ts: float | None
    first_token_ts: float | None
    completion_ts: float  # the FINISHED timestamp
    queue_time: float | None
    requeue_time: float
    ttft: float | None
    tpot: float | None
    e2e: float
    itl_per_emission: tuple[float, ...]  # len == num_emissions - 1 (0 if no tokens)
    itl_per_token: tuple[float, ...]  # len == num_output_tokens - tokens of the first emission
    finish_reason: FinishReason
    deadline_ts: float | None = None

    @property
    def succeeded(self) -> bool:
        """True when the request finished with `length` or `stop`."""
        return self.finish_reason in SUCCESS_REASONS

    @property
    def ran(self) -> bool:
        """True when the request ran: scheduled at least once or emitted a token, and not
        rejected. Latency statistics cover exactly these requests (see the module doc)."""
        if self.finish_reason is FinishReason.REJECTED:
            return False
        return self.first_scheduled_ts is not None or self.num_output_tokens > 0

    @property
    def met_deadline(self) -> bool | None:
        """Finished successfully by its deadline; None when it has no deadline."""
        if self.deadline_ts is None:
            return None
        return self.succeeded and self.completion_ts <= self.deadline_ts

    def as_row(self) -> dict[str, str | int | float | None]:
        """The scalar fields as a flat, JSON-ready row (ITL tuples left out)."""
        return {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "priority": self.priority,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "arrival_ts": self.arrival_ts,
            "first_scheduled_ts": self.first_scheduled_ts,
            "first_token_ts": self.first_token_ts,
            "finished_ts": self.completion_ts,
            "queue_time": self.queue_time,
            "requeue_time": self.requeue_time,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "num_preemptions": self.num_preemptions,
            "finish_reason": self.finish_reason.value,
        }


def _check(tl: Timeline) -> tuple[float, FinishReason]:
    rid = tl.request_id
    if tl.finished_ts is None or tl.finish_reason is None:
        raise ValueError(f"request {rid!r} never finished (no FINISHED event): cannot compute its metrics")
    if len(tl.token_ts) != len(tl.token_counts):
        raise ValueError(f"request {rid!r}: token_ts and token_counts differ in length")
    if not (
        _all_finite([tl.arrival_ts, tl.finished_ts, *tl.scheduled_ts, *tl.preempted_ts]) and _all_finite(tl.token_ts)
    ):
        raise ValueError(f"request {rid!r}: every timestamp must be a finite number")
    if tl.token_counts and min(tl.token_counts) < 1:
        raise ValueError(f"request {rid!r}: every TOKENS emission needs at least one token")
    num_sched, num_pre = len(tl.scheduled_ts), len(tl.preempted_ts)
    if not num_pre <= num_sched <= num_pre + 1:
        raise ValueError(f"request {rid!r}: {num_sched} SCHEDULED events cannot pair with {num_pre} PREEMPTED events")
    return tl.finished_ts, tl.finish_reason


def _all_finite(stamps: list[float]) -> bool:
    # a finite sum means every term is finite (an inf or NaN term makes it inf or NaN); only
    # finite terms whose sum overflows need the one-by-one check
    if math.isfinite(sum(stamps)):
        return True
    return all(math.isfinite(ts) for ts in stamps)


def queue_time(tl: Timeline) -> float | None:
    """First SCHEDULED − ARRIVED, or None if never scheduled."""
    return tl.scheduled_ts[0] - tl.arrival_ts if tl.scheduled_ts else None


def requeue_time(tl: Timeline, finished_ts: float) -> float:
    """Σ (next SCHEDULED − PREEMPTED); an unmatched last preemption runs to FINISHED."""
    total = 0.0
    for k, preempted in enumerate(tl.preempted_ts):
        # The state machine pairs the k-th preemption with the (k+1)-th admission; pairing by
        # index, not by timestamp, stays right when both happen at the same instant.
        readmitted = tl.scheduled_ts[k + 1] if k + 1 < len(tl.scheduled_ts) else finished_ts
        total += readmitted - preempted
    return total


def ttft(tl: Timeline) -> float | None:
    """First token − ARRIVED, or None if no token was emitted."""
    return tl.token_ts[0] - tl.arrival_ts if tl.token_ts else None


def tpot(tl: Timeline, num_tokens: int | None = None) -> float | None:
    """(last token − first token) / (output tokens − 1), or None below two output tokens;
    `num_tokens` is the output token count when the caller has it."""
    if num_tokens is None:
        num_tokens = sum(tl.token_counts)
    if num_tokens < 2:
        return None
    return (tl.token_ts[-1] - tl.token_ts[0]) / (num_tokens - 1)


def itls(tl: Timeline) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(per-emission gaps, per-token gaps): each gap split evenly over the later emission's tokens.
    With one token per emission (no speculative decoding) both are the same tuple."""
    stamps, counts = tl.token_ts, tl.token_counts
    if counts.count(1) == len(counts):
        gaps = tuple(map(operator.sub, stamps[1:], stamps[:-1]))
        return gaps, gaps
    per_emission: list[float] = []
    per_token: list[float] = []
    for prev_ts, ts, n in zip(tl.token_ts, tl.token_ts[1:], tl.token_counts[1:], strict=False):
        gap = ts - prev_ts
        per_emission.append(gap)
        per_token.extend([gap / n] * n)
    return tuple(per_emission), tuple(per_token)


def request_metrics(tl: Timeline, *, with_itls: bool = True) -> RequestMetrics:
    """Every per-request metric of one finished timeline; `ValueError` if it never finished.
    `with_itls=False` leaves the inter-token gaps empty (a summary pools them itself)."""
    finished_ts, reason = _check(tl)
    per_emission, per_token = itls(tl) if with_itls else ((), ())
    num_tokens = sum(tl.token_counts)
    return RequestMetrics(
        request_id=tl.request_id,
        tenant=tl.tenant,
        priority=tl.priority,
        num_prompt_tokens=tl.num_prompt_tokens,
        num_output_tokens=num_tokens,
        num_emissions=len(tl.token_ts),
        num_preemptions=len(tl.preempted_ts),
        arrival_ts=tl.arrival_ts,
        first_scheduled_ts=tl.scheduled_ts[0] if tl.scheduled_ts else None,
        first_token_ts=tl.token_ts[0] if tl.token_ts else None,
        completion_ts=finished_ts,
        queue_time=queue_time(tl),
        requeue_time=requeue_time(tl, finished_ts),
        ttft=ttft(tl),
        tpot=tpot(tl, num_tokens),
        e2e=finished_ts - tl.arrival_ts,  # E2E = FINISHED − ARRIVED
        itl_per_emission=per_emission,
        itl_per_token=per_token,
        finish_reason=reason,
        deadline_ts=tl.deadline_ts,
    )


def per_request_table(timelines: Iterable[Timeline]) -> list[RequestMetrics]:
    """`request_metrics` of every timeline, sorted by (arrival, request id).

    e.g. ``{m.request_id: m.ttft for m in per_request_table(tls)}`` gives the TTFT of each
    request, ``{m.request_id: m.completion_ts for m in ...}`` its completion time.
    """
    rows = [request_metrics(tl) for tl in timelines]
    rows.sort(key=lambda m: (m.arrival_ts, m.request_id))
    return rows
