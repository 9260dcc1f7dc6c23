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

The computation is vectorised: the per-request fields the summary reads are numpy columns
(`contbatch.metrics.columns`, equal to `request_metrics` field by field), every statistic is
taken with numpy (`stats.describe`, exact sums equal to `math.fsum`), and the numbers equal those
of the per-request definitions applied one request at a time.

Invariants of the returned dict: plain ``int``/``float``/``str``/``None``/``dict`` values only
(``json.dumps(..., allow_nan=False)`` succeeds); a statistic of an empty sample, and a rate over
a zero makespan, is None, never NaN or infinity; ``finish_reasons`` always holds all six reasons.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics.columns import (
    Mask,
    PooledItls,
    RequestColumns,
    columns_of_rows,
    pooled_itls,
    timeline_columns,
)
from contbatch.metrics.request import RequestMetrics, request_metrics
from contbatch.metrics.stats import Sample, check_time_unit, latency_keys, small_pages

__all__ = ["LATENCY_NAMES", "SLO", "PooledItls", "pooled_itls", "run_makespan", "summarize", "summarize_rows"]

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

    def met_by(self, cols: RequestColumns) -> Mask:
        """`is_met_by` of every request of `cols`, at once."""
        met = cols.succeeded
        if self.ttft is not None:
            met &= cols.has_ttft & ~(cols.ttft > self.ttft)
        if self.tpot is not None:
            met &= ~(cols.has_tpot & (cols.tpot > self.tpot))
        if self.e2e is not None:
            met &= cols.e2e <= self.e2e
        return met

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}


def _metrics_of(timelines: Iterable[Timeline], *, with_itls: bool = True) -> list[RequestMetrics]:
    rows = [request_metrics(tl, with_itls=with_itls) for tl in timelines]
    if not rows:
        raise ValueError("cannot summarize an empty list of timelines")
    _check_unique([m.request_id for m in rows])
    return rows


def _per_unit(amount: float, makespan: float) -> float | None:
    """`amount` / `makespan`; None when the makespan is zero (every event at one instant) or so
    small that the rate overflows a float."""
    if makespan <= 0:
        return None
    rate = float(amount) / makespan
    return rate if math.isfinite(rate) else None


def _count_keys(cols: RequestColumns) -> dict[str, object]:
    reasons = cols.reason_counts()
    return {
        "num_requests": len(cols),
        "completed": int(cols.succeeded.sum()),
        "finish_reasons": {reason.value: count for reason, count in reasons.items()},
        "num_rejected": reasons[FinishReason.REJECTED],
        "num_not_run": int((~cols.ran).sum()),
        "num_preemptions": int(cols.num_preemptions.sum()),
        "num_preempted_requests": int((cols.num_preemptions > 0).sum()),
        **_deadline_keys(cols),
    }


def _deadline_keys(cols: RequestColumns) -> dict[str, object]:
    """Deadline attainment = requests finished successfully by their deadline / requests with one."""
    num = int(cols.has_deadline.sum())
    if not num:
        return {}
    met = int((cols.has_deadline & cols.succeeded & (cols.completion_ts <= cols.deadline_ts)).sum())
    return {"num_deadline_requests": num, "num_deadline_misses": num - met, "deadline_attainment": met / num}


def run_makespan(cols: RequestColumns) -> float:
    """makespan = last FINISHED − first ARRIVED, over every request of the run."""
    return float(cols.completion_ts.max() - cols.arrival_ts.min())


def _throughput_keys(cols: RequestColumns, makespan: float) -> dict[str, object]:
    total_input = int(cols.num_prompt_tokens[cols.ran].sum())  # a prompt is processed when it runs
    total_output = int(cols.num_output_tokens.sum())
    return {
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": _per_unit(int(cols.succeeded.sum()), makespan),
        "output_throughput": _per_unit(total_output, makespan),
        "total_token_throughput": _per_unit(total_input + total_output, makespan),
    }


def _rows_itls(rows: list[RequestMetrics]) -> PooledItls:
    """The rows' own inter-token gaps, pooled, of the rows that ran."""
    rows = [m for m in rows if m.ran]
    per_emission = list(itertools.chain.from_iterable(m.itl_per_emission for m in rows))
    if all(m.itl_per_token is m.itl_per_emission for m in rows):  # one token per emission
        return per_emission, per_emission
    return per_emission, list(itertools.chain.from_iterable(m.itl_per_token for m in rows))


def _latency_keys(cols: RequestColumns, time_unit: str, itls: PooledItls) -> dict[str, object]:
    """Every latency statistic, over the requests that ran (`RequestMetrics.ran`) only; pooled
    `itls` must hold the gaps of exactly those requests (as `StreamingSummary` keeps them)."""
    ran = cols.ran
    samples: dict[str, Sample] = {
        "queue": cols.queue_time[ran & cols.has_queue_time],
        "requeue": cols.requeue_time[ran & (cols.num_preemptions > 0)],
        "ttft": cols.ttft[ran & cols.has_ttft],
        "tpot": cols.tpot[ran & cols.has_tpot],
        "itl": itls[0],
        "itl_per_token": itls[1],
        "e2el": cols.e2e[ran],
    }
    keys: dict[str, object] = {}
    described: dict[int, dict[str, float | None]] = {}  # per emission and per token may be one sample
    for name in LATENCY_NAMES:
        keys.update(latency_keys(name, samples[name], time_unit, described=described))
    return keys


def _goodput_keys(cols: RequestColumns, makespan: float, slo: SLO) -> dict[str, object]:
    good = slo.met_by(cols)
    num_good = int(good.sum())
    goodput = _per_unit(num_good, makespan)
    return {
        "slo": slo.as_dict(),
        "num_good_requests": num_good,
        "goodput": goodput,
        "request_goodput": goodput,
        "goodput_tokens": _per_unit(int(cols.num_output_tokens[good].sum()), makespan),
        "slo_attainment": num_good / len(cols),
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
    with small_pages():
        cols, itls = timeline_columns(timelines)  # validates as `request_metrics` does
        if not timelines:
            raise ValueError("cannot summarize an empty list of timelines")
        ids = [tl.request_id for tl in timelines]
        if len(set(ids)) != len(ids):
            _check_unique(ids)
        return _summary(
            cols, itls, time_unit=time_unit, padding_tokens=padding_tokens, unsent_tokens=unsent_tokens, slo=slo
        )


def _check_unique(ids: list[str]) -> None:
    """ValueError naming the first request id seen twice."""
    seen: set[str] = set()
    for rid in ids:
        if rid in seen:
            raise ValueError(f"request id {rid!r} appears in more than one timeline")
        seen.add(rid)


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
    with small_pages():
        cols = columns_of_rows(rows)
        pooled = itls if itls is not None else _rows_itls(rows)
        return _summary(
            cols, pooled, time_unit=time_unit, padding_tokens=padding_tokens, unsent_tokens=unsent_tokens, slo=slo
        )


def _summary(
    cols: RequestColumns,
    itls: PooledItls,
    *,
    time_unit: str,
    padding_tokens: int,
    unsent_tokens: int,
    slo: SLO | None,
) -> dict[str, object]:
    check_time_unit(time_unit)
    if padding_tokens < 0 or unsent_tokens < 0:
        raise ValueError(f"waste counts must be >= 0, got padding={padding_tokens} unsent={unsent_tokens}")
    if not len(cols):
        raise ValueError("cannot summarize an empty list of timelines")
    makespan = run_makespan(cols)
    summary: dict[str, object] = {"time_unit": time_unit, "duration": makespan, "makespan": makespan}
    summary.update(_count_keys(cols))
    summary.update(_throughput_keys(cols, makespan))
    summary["padding_waste"] = int(padding_tokens)
    summary["unsent_waste"] = int(unsent_tokens)
    summary.update(_latency_keys(cols, time_unit, itls))
    if slo is not None:
        summary.update(_goodput_keys(cols, makespan, slo))
    return summary
