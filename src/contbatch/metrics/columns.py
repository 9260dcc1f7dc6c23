"""Per-request metrics as columns: the run summary's input, computed with vectorised arithmetic.

`RequestColumns` holds, for n requests, the fields of `RequestMetrics` a run summary reads, one
numpy array per field (a latency that may be undefined comes with a ``has_`` mask). The
definitions are those of `contbatch.metrics.request` (queue time, TTFT, TPOT, E2E, the `ran`
rule), applied element by element with the same IEEE operations, so every value equals the one
`request_metrics` gives (`tests/metrics/test_metrics_columns.py` checks it field by field).

Two ways in, one result:

- `columns_of_rows(rows)`: gathers the fields of `RequestMetrics` already computed (streaming
  summaries, per-group summaries);
- `timeline_columns(timelines)`: straight from finished timelines, without building a row per
  request; it also returns the pooled inter-token gaps of the requests that ran (`PooledItls`,
  equal to each request's `request.itls` concatenated). It validates as `request_metrics` does:
  when any timeline breaks an invariant, the same `ValueError` is raised (the pure-Python check
  of `request._check` runs on the timelines in order and names the first one at fault).

Invariants: every array has length n; values where a ``has_`` mask is False are meaningless
(zero); a timestamp array holds only finite numbers (checked for timelines, given for rows).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics.request import SUCCESS_REASONS, RequestMetrics, _check, requeue_time

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
Sample = Sequence[float] | np.ndarray[Any, np.dtype[np.float64]]  # one latency's values
PooledItls = tuple[Sample, Sample]  # every inter-token gap: per emission, per token

REASONS: tuple[FinishReason, ...] = tuple(FinishReason)
_SUCCESS_CODES = [REASONS.index(reason) for reason in SUCCESS_REASONS]
_REJECTED_CODE = REASONS.index(FinishReason.REJECTED)
_CODE = {reason: code for code, reason in enumerate(REASONS)}


@dataclass(frozen=True, slots=True, eq=False)
class RequestColumns:
    """The summary-relevant fields of n `RequestMetrics`, one array each (see the module doc)."""

    num_prompt_tokens: Ints
    num_output_tokens: Ints
    num_preemptions: Ints
    arrival_ts: Floats
    completion_ts: Floats
    queue_time: Floats  # where has_queue_time
    requeue_time: Floats
    ttft: Floats  # where has_ttft
    tpot: Floats  # where has_tpot
    e2e: Floats
    reason: npt.NDArray[np.int8]  # index into REASONS
    deadline_ts: Floats  # where has_deadline
    has_queue_time: Mask
    has_ttft: Mask
    has_tpot: Mask
    has_deadline: Mask

    def __len__(self) -> int:
        return len(self.e2e)

    @property
    def succeeded(self) -> Mask:
        """`RequestMetrics.succeeded` of each: finished with `length` or `stop`."""
        succeeded: Mask = np.isin(self.reason, _SUCCESS_CODES)
        return succeeded

    @property
    def ran(self) -> Mask:
        """`RequestMetrics.ran` of each: scheduled at least once or emitted a token, and not
        rejected."""
        ran: Mask = (self.reason != _REJECTED_CODE) & (self.has_queue_time | (self.num_output_tokens > 0))
        return ran

    def reason_counts(self) -> dict[FinishReason, int]:
        """Requests per finish reason, every reason present (zeros too)."""
        counts = np.bincount(self.reason, minlength=len(REASONS))
        return {reason: int(counts[code]) for code, reason in enumerate(REASONS)}


def _optional(values: list[float | None], n: int) -> tuple[Floats, Mask]:
    """(values with None as 0.0, mask of those that are not None)."""
    present = list(map(operator.is_not, values, itertools.repeat(None)))
    out = np.zeros(n, dtype=np.float64)
    mask = np.array(present, dtype=bool)
    out[mask] = np.fromiter(itertools.compress(values, present), np.float64, int(mask.sum()))
    return out, mask


def _floats(values: Any, n: int) -> Floats:
    return np.fromiter(values, np.float64, n)


def _ints(values: Any, n: int) -> Ints:
    return np.fromiter(values, np.int64, n)


def columns_of_rows(rows: Sequence[RequestMetrics]) -> RequestColumns:
    """The columns of per-request metrics already computed."""
    n = len(rows)

    def col(name: str) -> Any:
        return map(operator.attrgetter(name), rows)

    queue, has_queue = _optional(list(col("queue_time")), n)
    ttft, has_ttft = _optional(list(col("ttft")), n)
    tpot, has_tpot = _optional(list(col("tpot")), n)
    deadline, has_deadline = _optional(list(col("deadline_ts")), n)
    return RequestColumns(
        num_prompt_tokens=_ints(col("num_prompt_tokens"), n),
        num_output_tokens=_ints(col("num_output_tokens"), n),
        num_preemptions=_ints(col("num_preemptions"), n),
        arrival_ts=_floats(col("arrival_ts"), n),
        completion_ts=_floats(col("completion_ts"), n),
        queue_time=queue,
        requeue_time=_floats(col("requeue_time"), n),
        ttft=ttft,
        tpot=tpot,
        e2e=_floats(col("e2e"), n),
        reason=np.fromiter(map(_CODE.__getitem__, col("finish_reason")), np.int8, n),
        deadline_ts=deadline,
        has_queue_time=has_queue,
        has_ttft=has_ttft,
        has_tpot=has_tpot,
        has_deadline=has_deadline,
    )


@dataclass(frozen=True, slots=True)
class _Tokens:
    """Every TOKENS emission of the timelines, concatenated: `stamps` (and `counts`, None when
    every emission carries one token), timeline k owning ``[starts[k], ends[k])``."""

    stamps: Floats
    counts: Ints | None
    lengths: Ints
    starts: Ints
    ends: Ints


def _tokens(timelines: Sequence[Timeline]) -> _Tokens | None:
    """The concatenated emissions; None when a timeline's counts do not pair with its stamps or
    an emission carries fewer than one token (`_check` then names it)."""
    n = len(timelines)
    stamp_lists = list(map(operator.attrgetter("token_ts"), timelines))
    count_lists = list(map(operator.attrgetter("token_counts"), timelines))
    lengths = _ints(map(len, stamp_lists), n)
    if not np.array_equal(lengths, _ints(map(len, count_lists), n)):
        return None
    total = int(lengths.sum())
    stamps = _floats(itertools.chain.from_iterable(stamp_lists), total)
    counts: Ints | None = None
    if sum(map(operator.methodcaller("count", 1), count_lists)) != total:
        counts = _ints(itertools.chain.from_iterable(count_lists), total)
        if counts.min() < 1:
            return None
    ends = np.cumsum(lengths)
    return _Tokens(stamps, counts, lengths, ends - lengths, ends)


def _pooled(tokens: _Tokens, keep: Mask) -> PooledItls:
    """The inter-token gaps of the timelines `keep` selects, per emission and per token: each
    timeline's `request.itls`, concatenated in order."""
    stamps, counts, lengths = tokens.stamps, tokens.counts, tokens.lengths
    if not keep.all():
        mine = np.repeat(keep, lengths)
        stamps, lengths = stamps[mine], lengths[keep]
        counts = counts[mine] if counts is not None else None
    total = len(stamps)
    inside = np.ones(max(total - 1, 0), dtype=bool)  # a gap inside one request, not across two
    ends = np.cumsum(lengths)[:-1]
    inside[ends[(ends > 0) & (ends < total)] - 1] = False
    per_emission = np.diff(stamps)[inside]
    if counts is None:
        return per_emission, per_emission
    later = counts[1:][inside]
    return per_emission, np.repeat(per_emission / later, later)


def pooled_itls(timelines: Sequence[Timeline]) -> PooledItls:
    """The inter-token gaps of `timelines`, per emission and per token (`request.itls` of each,
    concatenated), computed at once over all their token timestamps."""
    tokens = _tokens(timelines)
    if tokens is None:
        _raise_first_invalid(timelines)
    return _pooled(tokens, np.ones(len(timelines), dtype=bool))


def _stamps(lists: list[list[float]]) -> tuple[Floats, Ints]:
    """(every stamp of `lists` concatenated, each list's length)."""
    lengths = _ints(map(len, lists), len(lists))
    return _floats(itertools.chain.from_iterable(lists), int(lengths.sum())), lengths


def _raise_first_invalid(timelines: Sequence[Timeline]) -> NoReturn:
    """The `ValueError` of `request._check` for the first timeline at fault (the vectorised
    checks found one)."""
    for tl in timelines:
        _check(tl)
    raise AssertionError("timeline_columns: a timeline failed a check that request._check passes")


def timeline_columns(timelines: Sequence[Timeline]) -> tuple[RequestColumns, PooledItls]:
    """The columns of finished `timelines` and the pooled inter-token gaps of those that ran;
    `ValueError` (as `request_metrics` raises it) for the first timeline that breaks an invariant."""
    n = len(timelines)

    def col(name: str) -> list[Any]:
        return list(map(operator.attrgetter(name), timelines))

    finished, reasons = col("finished_ts"), col("finish_reason")
    if None in finished or None in reasons:
        _raise_first_invalid(timelines)
    tokens = _tokens(timelines)
    scheduled, num_scheduled = _stamps(col("scheduled_ts"))
    preempted, num_preempted = _stamps(col("preempted_ts"))
    arrival, completion = _floats(col("arrival_ts"), n), _floats(finished, n)
    if tokens is None or not (
        np.isfinite(arrival).all()
        and np.isfinite(completion).all()
        and np.isfinite(scheduled).all()
        and np.isfinite(preempted).all()
        and np.isfinite(tokens.stamps).all()
        and ((num_preempted <= num_scheduled) & (num_scheduled <= num_preempted + 1)).all()
    ):
        _raise_first_invalid(timelines)
    stamps, starts, ends = tokens.stamps, tokens.starts, tokens.ends
    if tokens.counts is None:
        num_tokens = tokens.lengths
    else:
        cumulative = np.concatenate(([0], np.cumsum(tokens.counts)))
        num_tokens = cumulative[ends] - cumulative[starts]
    has_token = tokens.lengths > 0
    first_token, last_token = np.zeros(n), np.zeros(n)
    first_token[has_token] = stamps[starts[has_token]]
    last_token[has_token] = stamps[ends[has_token] - 1]
    has_queue = num_scheduled > 0
    first_scheduled = np.zeros(n)
    first_scheduled[has_queue] = scheduled[(np.cumsum(num_scheduled) - num_scheduled)[has_queue]]
    has_tpot = num_tokens >= 2
    tpot = np.zeros(n)
    tpot[has_tpot] = (last_token[has_tpot] - first_token[has_tpot]) / (num_tokens[has_tpot] - 1)
    requeue = np.zeros(n)
    for k in np.flatnonzero(num_preempted).tolist():  # few: the definition's own loop, in `request`
        requeue[k] = requeue_time(timelines[k], finished[k])
    deadline, has_deadline = _optional(col("deadline_ts"), n)
    columns = RequestColumns(
        num_prompt_tokens=_ints(col("num_prompt_tokens"), n),
        num_output_tokens=num_tokens,
        num_preemptions=num_preempted,
        arrival_ts=arrival,
        completion_ts=completion,
        queue_time=np.where(has_queue, first_scheduled - arrival, 0.0),
        requeue_time=requeue,
        ttft=np.where(has_token, first_token - arrival, 0.0),
        tpot=tpot,
        e2e=completion - arrival,  # E2E = FINISHED − ARRIVED
        reason=np.fromiter(map(_CODE.__getitem__, reasons), np.int8, n),
        deadline_ts=deadline,
        has_queue_time=has_queue,
        has_ttft=has_token,
        has_tpot=has_tpot,
        has_deadline=has_deadline,
    )
    return columns, _pooled(tokens, columns.ran)
