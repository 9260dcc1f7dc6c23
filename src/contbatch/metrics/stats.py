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

import itertools
import math
from collections.abc import Sequence
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
    sees requests in finishing order, gives the same numbers as one over timelines).
    """
    if len(values) == 0:
        return dict.fromkeys(STAT_PREFIXES)
    with np.errstate(over="ignore", invalid="ignore"):
        arr = np.asarray(values, dtype=np.float64) * scale
        mean = np.float64(_exact_sum(arr) / len(arr)) if np.isfinite(arr).all() else np.mean(arr)
        spread = np.float64(math.sqrt(_exact_sum((arr - mean) ** 2) / len(arr))) if np.isfinite(mean) else np.std(arr)
        raw = [mean, np.median(arr), spread, np.min(arr), np.max(arr)]
        raw += list(np.percentile(arr, PERCENTILES))
    return {prefix: _plain(value) for prefix, value in zip(STAT_PREFIXES, raw, strict=True)}


_CHUNK = 1 << 16


def _exact_sum(arr: np.ndarray[Any, np.dtype[np.float64]]) -> float:
    """`math.fsum` of `arr`, fed as plain floats a chunk at a time (iterating numpy scalars is
    many times slower; converting all at once would hold 32 bytes per value)."""
    chunks = (arr[i : i + _CHUNK].tolist() for i in range(0, len(arr), _CHUNK))
    return math.fsum(itertools.chain.from_iterable(chunks))


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
