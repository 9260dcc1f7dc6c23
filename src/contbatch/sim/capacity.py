"""Capacity search: the highest request rate at which SLO attainment stays at or above a target,
and the number of replicas a given rate needs.

The trace is replayed at other rates by scaling its arrival times (`scale_to_rate`: same
requests, same order, same lengths). Attainment is `contbatch.metrics.summarize`'s: requests
meeting every objective / all requests (failed, rejected and timed-out ones are misses). The
search assumes attainment falls as the rate rises: it brackets the answer by doubling or
halving from the trace's own rate, then bisects until the bracket is within `rel_tol`. Every
rate it simulated is kept as a point of the curve (goodput and latency percentiles against
rate), sorted by rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from contbatch.core.base import SchedulerBase
from contbatch.metrics import SLO
from contbatch.sim.cost import CostModel
from contbatch.sim.loop import simulate
from contbatch.sim.pool import simulate_pool
from contbatch.traces import Trace
from contbatch.traces.synthetic import mean_rate, scale_to_rate


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    rate: float  # requests per time unit offered
    num_replicas: int
    summary: dict[str, object]  # summarize(...) with the SLO

    @property
    def attainment(self) -> float:
        value = self.summary.get("slo_attainment")
        return float(value) if isinstance(value, int | float) else 0.0


@dataclass(frozen=True, slots=True)
class CapacityResult:
    target: float
    max_rate: float | None  # the highest rate found to meet the target; None if even the lowest tried fails
    points: tuple[CapacityPoint, ...]  # every rate simulated, sorted by rate


@dataclass(frozen=True, slots=True)
class Planner:
    """One trace, scheduler factory, cost model and SLO, evaluated at any rate and pool size."""

    trace: Trace
    make_scheduler: Callable[[], SchedulerBase]
    cost: CostModel
    slo: SLO
    routing: str = "least_outstanding"

    def evaluate(self, rate: float, num_replicas: int = 1) -> CapacityPoint:
        scaled = scale_to_rate(self.trace, rate)
        if num_replicas == 1:
            result = simulate(scaled, self.make_scheduler(), self.cost)
        else:
            result = simulate_pool(
                scaled, self.make_scheduler, self.cost, num_replicas=num_replicas, routing=self.routing
            )
        summary = result.summary(self.slo)
        return CapacityPoint(rate, num_replicas, summary)


def find_capacity(
    planner: Planner, *, target: float = 0.9, num_replicas: int = 1, rel_tol: float = 0.02, max_runs: int = 24
) -> CapacityResult:
    """The highest rate with SLO attainment >= `target` (within `rel_tol`)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target}")
    points: dict[float, CapacityPoint] = {}

    def passes(rate: float) -> bool:
        if rate not in points:
            points[rate] = planner.evaluate(rate, num_replicas)
        return points[rate].attainment >= target

    low, high = _bracket(passes, mean_rate(planner.trace), max_runs // 2)
    while low is not None and high is not None and (high - low) > rel_tol * high and len(points) < max_runs:
        middle = (low + high) / 2
        low, high = (middle, high) if passes(middle) else (low, middle)
    return CapacityResult(target, low, tuple(points[r] for r in sorted(points)))


def _bracket(passes: Callable[[float], bool], start: float, max_tries: int) -> tuple[float | None, float | None]:
    """(a passing rate, a failing rate above it), by doubling or halving from `start`."""
    if passes(start):
        low, high = start, start * 2
        for _ in range(max_tries):
            if not passes(high):
                return low, high
            low, high = high, high * 2
        return low, None
    low, high = start / 2, start
    for _ in range(max_tries):
        if passes(low):
            return low, high
        low, high = low / 2, low
    return None, high


def replicas_needed(
    planner: Planner, rate: float, *, target: float = 0.9, max_replicas: int = 1024
) -> tuple[int | None, tuple[CapacityPoint, ...]]:
    """The fewest replicas meeting `target` at `rate` (None beyond `max_replicas`), and the
    points tried."""
    tried: dict[int, CapacityPoint] = {}

    def passes(n: int) -> bool:
        tried[n] = tried.get(n) or planner.evaluate(rate, n)
        return tried[n].attainment >= target

    high = 1
    while not passes(high):
        if high >= max_replicas:
            return None, tuple(tried[n] for n in sorted(tried))
        high = min(high * 2, max_replicas)
    low = high // 2  # fails (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if passes(middle) else (middle, high)
    return high, tuple(tried[n] for n in sorted(tried))
