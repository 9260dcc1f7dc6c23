"""One grid point: simulate (one replica, or a fleet: `contbatch.sweep.fleet`), then summarize.
The unit of work every runner ships to a worker.

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
from contbatch.sim.cost import CostModel, parse_cost
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
    fleet: dict[str, object] | None = None  # run on this fleet (contbatch.sweep.fleet); None: one replica


def run_point(trace: Trace, task: PointTask) -> dict[str, object]:
    """The summary of `trace` run as `task` says; ``{"error": message}`` if the run stalled."""
    cost = parse_cost(task.cost)
    if task.fleet is not None:
        return _run_fleet(trace, task, cost)
    scheduler = make_scheduler(task.scheduler, task.config)
    try:
        sim = simulate(trace, scheduler, cost, acceptance_rate=task.acceptance_rate, seed=task.seed)
    except SimulationStalled as exc:
        return {"error": f"simulation stalled: {exc}"}
    summary = sim.summary(task.slo)
    summary.update(sim.run_stats())
    return summary


def _run_fleet(trace: Trace, task: PointTask, cost: CostModel) -> dict[str, object]:
    from contbatch.sim.cluster import simulate_cluster
    from contbatch.sweep.fleet import make_fleet

    assert task.fleet is not None
    fleet = make_fleet(task.fleet, task.cost, cost, task.config, task.scheduler)
    interval = task.fleet.get("sample_interval")
    try:
        result = simulate_cluster(trace, fleet, sample_interval=float(interval) if interval else None)  # type: ignore[arg-type]
    except RuntimeError as exc:
        return {"error": f"simulation stalled: {exc}"}
    summary = result.summary(task.slo)
    stats = result.as_sim_result(task.scheduler).run_stats()
    out: dict[str, object] = {**summary, **stats, **result.fleet_stats(summary)}
    if interval:  # what the per-point fleet figures draw (not a result column)
        out["fleet_series"] = {"load": [tuple(p) for p in result.load_series],
                               "pools": [tuple(p) for p in result.pool_series]}  # fmt: skip
    return out
