"""Distribution statistics and time units for summaries.

This module owns two things every summary key depends on:

- the time units: a run's clock is ``"s"`` or ``"tick"``. Latency keys carry the suffix
  ``_ms`` (values × 1000) for seconds, as `vllm bench serve` does, and ``_ticks`` (values as is)
  for ticks. Makespan, throughput and SLO thresholds stay in the run's own unit.
- the statistics of one latency sample: mean, median, std, min, max, p90, p95, p99. Percentiles
  use numpy's default (linear interpolation) method, std is the population std (ddof=0, as
  `vllm bench serve`). Invariant: every value is a plain Python float, or None for an empty
  sample: never a numpy scalar, never NaN.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np

TIME_UNITS: Final[tuple[str, ...]] = ("s", "tick")
PERCENTILES: Final[tuple[int, ...]] = (90, 95, 99)
# Order matters: `describe` computes the statistics in this order.
STAT_PREFIXES: Final[tuple[str, ...]] = ("mean", "median", "std", "min", "max", "p90", "p95", "p99")


def check_time_unit(time_unit: str) -> str:
    """Return `time_unit` if it is ``"s"`` or ``"tick"``, else raise `ValueError`."""
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {TIME_UNITS}, got {time_unit!r}")
    return time_unit


def latency_suffix(time_unit: str) -> str:
    """``"ms"`` for a seconds clock, ``"ticks"`` for a tick clock."""
    return "ms" if check_time_unit(time_unit) == "s" else "ticks"


def latency_scale(time_unit: str) -> float:
    """Factor from the run unit to the latency-key unit: 1000 for seconds, 1 for ticks."""
    return 1000.0 if check_time_unit(time_unit) == "s" else 1.0


Sample = Sequence[float] | np.ndarray[Any, np.dtype[np.float64]]  # one latency's values


def describe(values: Sample, scale: float = 1.0) -> dict[str, float | None]:
    """{prefix: statistic} for every prefix in `STAT_PREFIXES`, of `values` × `scale`.

    An empty sample gives None for every statistic; a statistic that overflows a float (only
    possible near 1e308) is None too. Mean and standard deviation are exactly rounded sums
    (`math.fsum`), so they do not depend on the order of `values` (a streaming summary, which
    sees requests in finishing order, gives the same numbers as one over timelines). Every
    statistic depends on the values alone, not their order; they are computed with vectorised
    arithmetic (`_exact_sum` equals `math.fsum`) on one sorted copy of the sample, which the
    median and the percentiles then reorder in place (no further copy of a large sample).
    """
    if len(values) == 0:
        return dict.fromkeys(STAT_PREFIXES)
    with np.errstate(over="ignore", invalid="ignore"):
        arr = np.asarray(values, dtype=np.float64) * scale
        arr.sort()  # -inf first, +inf and NaN last
        finite = math.isfinite(arr[0]) and math.isfinite(arr[-1])
        mean = np.float64(_exact_sum(arr) / len(arr)) if finite else np.mean(arr)
        finite_mean = np.isfinite(mean)
        spread = np.float64(math.sqrt(_exact_sum(arr, about=float(mean)) / len(arr))) if finite_mean else np.std(arr)
        low, high = np.min(arr), np.max(arr)
        raw = [mean, _sorted_median(arr), spread, low, high]
        raw += _sorted_percentiles(arr)
    return {prefix: _plain(value) for prefix, value in zip(STAT_PREFIXES, raw, strict=True)}


def _sorted_median(arr: np.ndarray[Any, np.dtype[np.float64]]) -> np.float64:
    """`np.median` of a sorted sample (NaN last), the same float, without the walk over the sample
    and the masked-array module (`numpy.ma`, some 20 ms to import) that `np.median` takes: the
    middle value, or the mean of the middle two as `np.mean` computes it ((a + b) / 2); NaN
    when the sample holds a NaN."""
    n = len(arr)
    if math.isnan(arr[-1]):
        return np.float64(math.nan)
    mid = n // 2
    return np.float64(arr[mid]) if n % 2 else (arr[mid - 1] + arr[mid]) / np.float64(2.0)


_QUANTILES = np.true_divide(PERCENTILES, 100)  # as np.percentile divides them


def _sorted_percentiles(arr: np.ndarray[Any, np.dtype[np.float64]]) -> list[np.float64]:
    """`np.percentile(arr, PERCENTILES)` of a sorted sample (NaN last), the same floats: numpy's
    linear method step by step (virtual index (n - 1) q, its floor and the next index, -1 for
    both at or past the last, numpy's two-sided lerp), without the partition and the
    `np.unique` that imports `numpy.ma` (some 40 ms) in `np.percentile`; NaN when the sample
    holds a NaN."""
    n = len(arr)
    if math.isnan(arr[-1]):
        return [np.float64(math.nan)] * len(PERCENTILES)
    virtual = (n - 1) * _QUANTILES
    previous = np.floor(virtual)
    following = previous + 1
    past_last = virtual >= n - 1
    previous[past_last] = following[past_last] = -1
    before, after = previous.astype(np.intp), following.astype(np.intp)
    gamma = virtual - before
    low, high = arr[before], arr[after]
    diff = high - low
    lerp = low + diff * gamma
    np.subtract(high, diff * (1 - gamma), out=lerp, where=gamma >= 0.5)
    return list(lerp)


_CHUNK = 1 << 16


def _fsum(arr: np.ndarray[Any, np.dtype[np.float64]]) -> float:
    """`math.fsum` of `arr`, fed as plain floats a chunk at a time (iterating numpy scalars is
    many times slower; converting all at once would hold 32 bytes per value). The reference
    `_exact_sum` equals, and its path for non-finite or huge values."""
    chunks = (arr[i : i + _CHUNK].tolist() for i in range(0, len(arr), _CHUNK))
    return math.fsum(itertools.chain.from_iterable(chunks))


_SAFE_BOUND = 2.0**1000  # n * max|x| below it: no partial sum of fsum can overflow
_BINS = 2099  # frexp exponents -1073 (the smallest subnormal) .. 1024, shifted by 1074
_SPLIT = 2.0**26
_BLOCK = 1 << 18  # values per vectorised block: its temporaries (2 MB) stay small
_FLUSH = 1 << 24  # values per float bin sum: each stays below 2**53, exact


def _terms(block: np.ndarray[Any, np.dtype[np.float64]], about: float | None) -> np.ndarray[Any, np.dtype[np.float64]]:
    if about is None:
        return block
    deviation = block - about
    deviation *= deviation
    return deviation


def _exact_sum(arr: np.ndarray[Any, np.dtype[np.float64]], *, about: float | None = None) -> float:
    """`math.fsum(arr)` (the exact sum, correctly rounded), or with `about` the `math.fsum` of
    `(arr - about) ** 2`, computed with vectorised arithmetic a block at a time.

    Each term is m * 2**(e - 53) with m an integer below 2**53 (`np.frexp`); the m are summed
    exactly per exponent e (`_bin_sums`: float halves, or integer products for runs of equal
    values), the per-exponent integers are combined as Python integers and rounded once
    (`int / int` is correctly rounded, as fsum is); n equal terms sum to n * v, rounded once by
    that product. Non-finite terms, and terms whose sum could overflow (where fsum raises or
    returns inf or NaN), take `_fsum` itself: every outcome is fsum's.
    """
    n = len(arr)
    if n == 0:
        return 0.0
    blocks = [arr[i : i + _BLOCK] for i in range(0, n, _BLOCK)]
    lowest, highest, finite = math.inf, -math.inf, True
    for block in blocks:
        terms = _terms(block, about)
        finite = finite and bool(np.isfinite(terms).all())
        lowest, highest = min(lowest, float(terms.min())), max(highest, float(terms.max()))
    if not finite or max(-lowest, highest) * n >= _SAFE_BOUND:
        return _fsum(arr if about is None else _terms(arr, about))
    if lowest == highest:  # n equal terms: the exact sum n * v, rounded once by the product
        return float(n) * lowest + 0.0  # (+ 0.0: fsum's zero is never negative)
    runs = [_runs(block) for block in blocks]
    if n < _RUN_LIMIT and sum(len(values) for values, _ in runs) * _RUN_GAIN <= n:
        totals = _run_bin_sums(runs, about)
    else:
        totals = _bin_sums(blocks, about)
    if not totals:
        return 0.0
    first = min(totals)
    total = sum(value << (b - first) for b, value in totals.items())
    shift = first - 1074 - 53  # the value of bin b's unit is 2**(b - 1074 - 53)
    return float(total << shift) if shift >= 0 else total / (1 << -shift)


_RUN_GAIN = 4  # runs of equal values are summed as such when they average this many values or more
_RUN_LIMIT = 1 << 35  # and the values number below this (their int64 sums stay exact)


def _bin_sums(blocks: list[np.ndarray[Any, np.dtype[np.float64]]], about: float | None) -> dict[int, int]:
    """{bin: the exact sum of the m of the terms of exponent bin - 1074} (`_exact_sum`'s terms,
    finite): m is split into two halves below 2**27 and 2**26, and the halves are summed per
    exponent (`np.bincount`; float sums of at most 2**24 such integers are exact)."""
    high_sums, low_sums = np.zeros(_BINS), np.zeros(_BINS)
    totals: dict[int, int] = {}
    for k, block in enumerate(blocks):
        whole, exponent = np.frexp(_terms(block, about))
        np.ldexp(whole, 53, out=whole)  # exact integers, |whole| < 2**53
        high = whole * (1.0 / _SPLIT)
        np.trunc(high, out=high)  # |high| < 2**27
        whole -= high * _SPLIT  # the low half: |low| < 2**26, exact
        bins = exponent.astype(np.intp)
        bins += 1074
        high_sums += np.bincount(bins, weights=high, minlength=_BINS)
        low_sums += np.bincount(bins, weights=whole, minlength=_BINS)
        if (k + 1) * _BLOCK % _FLUSH == 0 or k == len(blocks) - 1:
            for b in np.flatnonzero((high_sums != 0) | (low_sums != 0)).tolist():
                totals[b] = totals.get(b, 0) + (int(high_sums[b]) << 26) + int(low_sums[b])
            high_sums[:], low_sums[:] = 0.0, 0.0
    return totals


def _runs(
    block: np.ndarray[Any, np.dtype[np.float64]],
) -> tuple[np.ndarray[Any, np.dtype[np.float64]], np.ndarray[Any, np.dtype[np.int64]]]:
    """(`block` with each run of equal neighbours once, the length of each run): a sorted sample
    of few distinct values (inter-token gaps: one per step) shrinks to them."""
    change = np.empty(len(block), dtype=bool)
    change[0] = True
    np.not_equal(block[1:], block[:-1], out=change[1:])
    starts = np.flatnonzero(change)
    lengths = np.diff(starts, append=len(block))
    return block[starts], lengths


def _run_bin_sums(
    runs: list[tuple[np.ndarray[Any, np.dtype[np.float64]], np.ndarray[Any, np.dtype[np.int64]]]],
    about: float | None,
) -> dict[int, int]:
    """`_bin_sums` of the terms that `runs` (values, run lengths) hold, each term counted its
    run's length times: m (an exact int64) is split into halves below 2**27 and 2**26 and each
    is multiplied by the run's length in int64, then summed per exponent in int64 (`np.add.at`):
    exact while the values number below 2**35."""
    high_sums = np.zeros(_BINS, dtype=np.int64)
    low_sums = np.zeros(_BINS, dtype=np.int64)
    for values, lengths in runs:
        whole, exponent = np.frexp(_terms(values, about))
        m = np.ldexp(whole, 53).astype(np.int64)  # exact integers, |m| < 2**53
        high = m >> 26  # (floor: m = high * 2**26 + low, 0 <= low < 2**26)
        low = m - (high << 26)
        bins = exponent.astype(np.intp)
        bins += 1074
        np.add.at(high_sums, bins, high * lengths)
        np.add.at(low_sums, bins, low * lengths)
    nonzero = np.flatnonzero((high_sums != 0) | (low_sums != 0)).tolist()
    return {b: (int(high_sums[b]) << 26) + int(low_sums[b]) for b in nonzero}


def _hugepage_switch() -> Callable[[bool], bool] | None:
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    switch: Callable[[bool], bool] | None = getattr(multiarray, "_set_madvise_hugepage", None)
    return switch


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """Within: numpy does not ask the kernel for huge pages for its large arrays.

    numpy advises huge pages (``madvise``) for every array of 4 MB or more; where the kernel
    then compacts memory to find them (transparent huge pages with ``defrag=madvise``, as on
    the machines measured), each such array costs system time far beyond its arithmetic: the
    summary of 100,000 requests (12.7 million gaps) took 10 s instead of 2.9 s. The summary
    makes a few short-lived arrays of that size, so it gains nothing from huge pages. The
    setting is numpy's own runtime switch (the one `NUMPY_MADVISE_HUGEPAGE` sets), restored on
    exit; it changes no value, only how memory is mapped.
    """
    switch = _hugepage_switch()
    if switch is None:
        yield
        return
    previous = switch(False)
    try:
        yield
    finally:
        switch(previous)


def _plain(value: np.floating[Any]) -> float | None:
    """A plain float, or None for a value that overflowed (never inf or NaN in a summary)."""
    number = float(value)
    return number if math.isfinite(number) else None


def latency_keys(
    name: str, values: Sample, time_unit: str, *, described: dict[int, dict[str, float | None]] | None = None
) -> dict[str, float | None]:
    """`describe(values)` keyed as `vllm bench serve` does: ``mean_ttft_ms``, ``p99_ttft_ticks``...
    `described` (by `id(values)`) keeps statistics already computed, for a sample shared by names."""
    suffix = latency_suffix(time_unit)
    cache = described if described is not None else {}
    if id(values) not in cache:
        cache[id(values)] = describe(values, latency_scale(time_unit))
    stats = cache[id(values)]
    return {f"{prefix}_{name}_{suffix}": stats[prefix] for prefix in STAT_PREFIXES}
