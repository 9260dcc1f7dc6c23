"""The engine's capacity as the calibrated simulator sees it, and the workloads calibration uses.

Capacity here is throughput, not an SLO: the request rate the engine drains when it never runs
out of work. It is measured in the simulator in two passes: the trace offered all but at once
(arrivals compressed to 1,000 times the trace's rate) gives a first throughput; the trace offered
at twice that rate, so that a queue persists but prefills arrive spread out as in a real
overload, gives the capacity (completed requests / makespan).
"""

from __future__ import annotations

from contbatch.core import SchedulerConfig, make_scheduler
from contbatch.sim.cost import CostModel
from contbatch.sim.loop import simulate
from contbatch.traces import Trace
from contbatch.traces.synthetic import generate, mean_rate, poisson, scale_to_rate, uniform

BURST_FACTOR = 1000.0
OVERLOAD_FACTOR = 2.0


def request_throughput(trace: Trace, config: SchedulerConfig, cost: CostModel, kind: str = "continuous") -> float:
    """Completed requests per second of `trace` in the simulator."""
    summary = simulate(trace, make_scheduler(kind, config), cost).summary()
    value = summary["request_throughput"]
    if not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"trace {trace.name!r}: the simulator completed no request")
    return float(value)


def saturation_rate(trace: Trace, config: SchedulerConfig, cost: CostModel, kind: str = "continuous") -> float:
    """The capacity of the module docstring, in requests per second."""
    burst = request_throughput(scale_to_rate(trace, mean_rate(trace) * BURST_FACTOR), config, cost, kind)
    return request_throughput(scale_to_rate(trace, burst * OVERLOAD_FACTOR), config, cost, kind)


def workload(
    name: str,
    num_requests: int,
    rate: float,
    *,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int,
) -> Trace:
    """Poisson arrivals at `rate` per second, uniform prompt and output lengths (inclusive ranges)."""
    source = (
        f"contbatch.calibrate workload: {num_requests} requests, Poisson {rate:.4g}/s, prompts "
        f"{prompt_tokens[0]}-{prompt_tokens[1]}, outputs {output_tokens[0]}-{output_tokens[1]} tokens, seed {seed}"
    )
    return generate(
        name, num_requests, poisson(rate), uniform(*prompt_tokens), uniform(*output_tokens), seed=seed, source=source
    )
