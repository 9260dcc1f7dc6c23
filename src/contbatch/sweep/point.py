"""One grid point: simulate, then summarize. The unit of work every runner ships to a worker.

`PointTask` is small and picklable (the trace travels separately, once per distinct rate);
`run_point` is a module-level function so that process pools and Ray can import it by name. A
point whose simulation stalls is not an error of the sweep: its result carries ``error`` and no
metrics. The result is the full JSON-ready summary (`summarize` + `SimResult.run_stats`, as
``contbatch simulate`` reports it), so the same inputs give the same dict in any process.
"""

from __future__ import annotations

from dataclasses import dataclass

from contbatch.core import SchedulerConfig, make_scheduler
from contbatch.metrics import SLO
from contbatch.sim.cost import parse_cost
from contbatch.sim.loop import SimulationStalled, simulate
from contbatch.traces import Trace


@dataclass(frozen=True, slots=True)
class PointTask:
    index: int
    scheduler: str
    config: SchedulerConfig
    cost: str  # a cost model spec (parsed in the worker)
    slo: SLO | None
    acceptance_rate: float
    seed: int


def run_point(trace: Trace, task: PointTask) -> dict[str, object]:
    """The summary of `trace` run as `task` says; ``{"error": message}`` if the run stalled."""
    cost = parse_cost(task.cost)
    scheduler = make_scheduler(task.scheduler, task.config)
    try:
        sim = simulate(trace, scheduler, cost, acceptance_rate=task.acceptance_rate, seed=task.seed)
    except SimulationStalled as exc:
        return {"error": f"simulation stalled: {exc}"}
    summary = sim.summary(task.slo)
    summary.update(sim.run_stats())
    return summary
