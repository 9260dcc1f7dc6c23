"""Run summaries: one JSON-ready dict of every aggregate metric of a set of timelines.

This module owns the run-level definitions; each is written beside its computation:

- makespan   = last FINISHED − first ARRIVED, in the run unit. ``duration`` repeats it under
  `vllm bench serve`'s name.
- throughput = output tokens / makespan (``output_throughput``), completed requests / makespan
  (``request_throughput``), (input + output tokens) / makespan (``total_token_throughput``), in
  the run unit (per second or per tick). Output tokens count every token emitted, including
  those of requests later cancelled, timed out or failed (their waste is ``unsent_waste``).
  Input tokens count the prompts of requests that ran (`RequestMetrics.ran`); the prompt of a
  request that never ran was never processed. ``completed`` counts requests that finished with
  ``length`` or ``stop``.
- counts: ``num_requests`` (every request), ``finish_reasons`` (all six, zeros too),
  ``num_rejected`` (finished ``rejected``) and ``num_not_run`` (requests that did not run:
  the rejected ones and those cancelled or timed out before they were ever scheduled).
- latency statistics (see `stats.describe`) over the requests that RAN (`RequestMetrics.ran`:
  scheduled at least once or emitted a token, and not rejected), each over those for which the
  latency is defined: queue time over them all (a request that ran was scheduled), requeue time
  over the preempted ones, TTFT over those that emitted a token, TPOT over those with two or more
  output tokens, ITL over every gap of every one of them (pooled), E2E over them all. A request
  that did not run enters no latency (a rejection would otherwise be an E2E of 0): it is
  reported in the counts above, and is a miss for goodput.
- goodput    = requests meeting every SLO given / makespan (``goodput``, alias
  ``request_goodput``), their output tokens / makespan (``goodput_tokens``), and the fraction of
  all requests meeting it (``slo_attainment``). See `SLO.is_met_by`.
- padding waste = token-work computed for no request, and unsent waste = tokens generated but
  never delivered; both are counted by the executor and passed in as is.

Invariants of the returned dict: plain ``int``/``float``/``str``/``None``/``dict`` values only
(``json.dumps(..., allow_nan=False)`` succeeds); a statistic of an empty sample, and a rate over
a zero makespan, is None, never NaN or infinity; ``finish_reasons`` always holds all six reasons.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics.request import RequestMetrics, request_metrics
from contbatch.metrics.stats import Sample, check_time_unit, latency_keys

PooledItls = tuple[Sample, Sample]  # every inter-token gap: per emission, per token

LATENCY_NAMES: tuple[str, ...] = ("queue", "requeue", "ttft", "tpot", "itl", "itl_per_token", "e2el")
"""Latency key stems, in summary order: ``mean_<stem>_ms`` etc."""


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives, each optional, in the run's time unit (seconds or ticks)."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "e2e"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"SLO {name} must be a non-negative number, got {value!r}")

    def is_met_by(self, m: RequestMetrics) -> bool:
        """True when `m` completed (length/stop) and meets every objective given.

        A failed, cancelled, timed-out, rejected or errored request is a miss. TTFT needs a first
        token; a request with fewer than two output tokens has no TPOT and meets any TPOT SLO.
        """
        if not m.succeeded:
            return False
        if self.ttft is not None and (m.ttft is None or m.ttft > self.ttft):
            return False
        if self.tpot is not None and m.tpot is not None and m.tpot > self.tpot:
            return False
        return self.e2e is None or m.e2e <= self.e2e

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}


def _metrics_of(timelines: Iterable[Timeline], *, with_itls: bool = True) -> list[RequestMetrics]:
    rows = [request_metrics(tl, with_itls=with_itls) for tl in timelines]
    if not rows:
        raise ValueError("cannot summarize an empty list of timelines")
    seen: set[str] = set()
    for m in rows:
        if m.request_id in seen:
            raise ValueError(f"request id {m.request_id!r} appears in more than one timeline")
        seen.add(m.request_id)
    return rows


def pooled_itls(timelines: Sequence[Timeline]) -> PooledItls:
    """The inter-token gaps of `timelines`, per emission and per token (`request.itls` of each,
    concatenated), computed at once over all their token timestamps."""
    lengths = np.fromiter((len(tl.token_ts) for tl in timelines), dtype=np.int64, count=len(timelines))
    total = int(lengths.sum())
    stamps = np.fromiter(itertools.chain.from_iterable(tl.token_ts for tl in timelines), dtype=np.float64, count=total)
    keep = np.ones(max(total - 1, 0), dtype=bool)  # a gap inside one request, not across two
    ends = np.cumsum(lengths)[:-1]
    keep[ends[(ends > 0) & (ends < total)] - 1] = False
    per_emission = np.diff(stamps)[keep]
    if all(tl.token_counts.count(1) == len(tl.token_counts) for tl in timelines):
        return per_emission, per_emission
    counts = np.fromiter(itertools.chain.from_iterable(tl.token_counts for tl in timelines), np.int64, count=total)
    later = counts[1:][keep]
    return per_emission, np.repeat(per_emission / later, later)


def _per_unit(amount: float, makespan: float) -> float | None:
    """`amount` / `makespan`; None when the makespan is zero (every event at one instant) or so
    small that the rate overflows a float."""
    if makespan <= 0:
        return None
    rate = float(amount) / makespan
    return rate if math.isfinite(rate) else None


def _count_keys(rows: list[RequestMetrics]) -> dict[str, object]:
    reasons = {reason.value: 0 for reason in FinishReason}
    for m in rows:
        reasons[m.finish_reason.value] += 1
    return {
        "num_requests": len(rows),
        "completed": sum(1 for m in rows if m.succeeded),
        "finish_reasons": reasons,
        "num_rejected": reasons[FinishReason.REJECTED.value],
        "num_not_run": sum(1 for m in rows if not m.ran),
        "num_preemptions": sum(m.num_preemptions for m in rows),
        "num_preempted_requests": sum(1 for m in rows if m.num_preemptions > 0),
        **_deadline_keys(rows),
    }


def _deadline_keys(rows: list[RequestMetrics]) -> dict[str, object]:
    """Deadline attainment = requests finished successfully by their deadline / requests with one."""
    verdicts = [m.met_deadline for m in rows if m.met_deadline is not None]
    if not verdicts:
        return {}
    return {
        "num_deadline_requests": len(verdicts),
        "num_deadline_misses": verdicts.count(False),
        "deadline_attainment": verdicts.count(True) / len(verdicts),
    }


def run_makespan(rows: list[RequestMetrics]) -> float:
    """makespan = last FINISHED − first ARRIVED, over every request of the run."""
    return float(max(m.completion_ts for m in rows) - min(m.arrival_ts for m in rows))


def _throughput_keys(rows: list[RequestMetrics], makespan: float) -> dict[str, object]:
    total_input = sum(m.num_prompt_tokens for m in rows if m.ran)  # a prompt is processed when it runs
    total_output = sum(m.num_output_tokens for m in rows)
    return {
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": _per_unit(sum(1 for m in rows if m.succeeded), makespan),
        "output_throughput": _per_unit(total_output, makespan),
        "total_token_throughput": _per_unit(total_input + total_output, makespan),
    }


def _latency_keys(rows: list[RequestMetrics], time_unit: str, itls: PooledItls | None = None) -> dict[str, object]:
    """Every latency statistic, over the requests that ran (`RequestMetrics.ran`) only; pooled
    `itls` must hold the gaps of exactly those requests (as `StreamingSummary` keeps them)."""
    rows = [m for m in rows if m.ran]
    if itls is None:
        per_emission = list(itertools.chain.from_iterable(m.itl_per_emission for m in rows))
        if all(m.itl_per_token is m.itl_per_emission for m in rows):  # one token per emission
            itls = (per_emission, per_emission)
        else:
            itls = (per_emission, list(itertools.chain.from_iterable(m.itl_per_token for m in rows)))
    samples: dict[str, Sample] = {
        "queue": [m.queue_time for m in rows if m.queue_time is not None],
        "requeue": [m.requeue_time for m in rows if m.num_preemptions > 0],
        "ttft": [m.ttft for m in rows if m.ttft is not None],
        "tpot": [m.tpot for m in rows if m.tpot is not None],
        "itl": itls[0],
        "itl_per_token": itls[1],
        "e2el": [m.e2e for m in rows],
    }
    keys: dict[str, object] = {}
    described: dict[int, dict[str, float | None]] = {}  # per emission and per token may be one sample
    for name in LATENCY_NAMES:
        keys.update(latency_keys(name, samples[name], time_unit, described=described))
    return keys


def _goodput_keys(rows: list[RequestMetrics], makespan: float, slo: SLO) -> dict[str, object]:
    good = [m for m in rows if slo.is_met_by(m)]
    goodput = _per_unit(len(good), makespan)
    return {
        "slo": slo.as_dict(),
        "num_good_requests": len(good),
        "goodput": goodput,
        "request_goodput": goodput,
        "goodput_tokens": _per_unit(sum(m.num_output_tokens for m in good), makespan),
        "slo_attainment": len(good) / len(rows),
    }


def summarize(
    timelines: Iterable[Timeline],
    *,
    time_unit: str,
    padding_tokens: int = 0,
    unsent_tokens: int = 0,
    slo: SLO | None = None,
) -> dict[str, object]:
    """Summarize finished timelines of one run whose clock unit is `time_unit` ("s" or "tick").

    Raises `ValueError` for an empty input, an unfinished timeline (naming it), a duplicate
    request id, an unknown time unit or a negative waste count. SLO keys appear only with `slo`.
    """
    timelines = list(timelines)
    rows = _metrics_of(timelines, with_itls=False)  # the gaps are pooled at once, below
    itls = pooled_itls([tl for tl, m in zip(timelines, rows, strict=True) if m.ran])
    return summarize_rows(
        rows, time_unit=time_unit, padding_tokens=padding_tokens, unsent_tokens=unsent_tokens, slo=slo, itls=itls
    )


def summarize_rows(
    rows: list[RequestMetrics],
    *,
    time_unit: str,
    padding_tokens: int = 0,
    unsent_tokens: int = 0,
    slo: SLO | None = None,
    itls: PooledItls | None = None,
) -> dict[str, object]:
    """`summarize` of per-request metrics already computed; `itls` (per emission, per token)
    replaces the rows' own inter-token gaps when they were pooled as the rows were made (the
    gaps of the rows that ran, `RequestMetrics.ran`, only)."""
    check_time_unit(time_unit)
    if padding_tokens < 0 or unsent_tokens < 0:
        raise ValueError(f"waste counts must be >= 0, got padding={padding_tokens} unsent={unsent_tokens}")
    if not rows:
        raise ValueError("cannot summarize an empty list of timelines")
    makespan = run_makespan(rows)
    summary: dict[str, object] = {"time_unit": time_unit, "duration": makespan, "makespan": makespan}
    summary.update(_count_keys(rows))
    summary.update(_throughput_keys(rows, makespan))
    summary["padding_waste"] = int(padding_tokens)
    summary["unsent_waste"] = int(unsent_tokens)
    summary.update(_latency_keys(rows, time_unit, itls))
    if slo is not None:
        summary.update(_goodput_keys(rows, makespan, slo))
    return summary
