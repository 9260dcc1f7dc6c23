"""A pool of identical replicas behind one router: the simplest fleet, kept for capacity
planning ("how many replicas for this trace at this SLO") and its callers.

`simulate_pool` is `contbatch.sim.cluster.simulate_cluster` on one aggregated pool of
`num_replicas` replicas made from `make_scheduler`'s config, with `routing` any router spec of
`contbatch.routing` (`round_robin`, `least_outstanding`, `least_kv`, `least_work`,
`prefix_affinity`, `weighted:...`), returned as one `SimResult` (steps, busy time and padding
summed over replicas).

Invariant: every trace request is routed to exactly one replica and finishes there with one
finish reason; the per-request timelines are those of the replica that served it.
"""

from __future__ import annotations

from collections.abc import Callable

from contbatch.core.base import SchedulerBase
from contbatch.routing import ROUTERS
from contbatch.sim.cluster import simulate_cluster
from contbatch.sim.cluster_config import FleetSpec, PoolSpec
from contbatch.sim.cost import CostModel
from contbatch.sim.loop import SimResult
from contbatch.traces import Trace

ROUTINGS = tuple(ROUTERS)


def pool_fleet(
    make_scheduler: Callable[[], SchedulerBase], cost: CostModel, num_replicas: int, routing: str
) -> FleetSpec:
    """The fleet `simulate_pool` runs."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    model = make_scheduler()
    pool = PoolSpec("replica", cost, model.config, num_replicas, scheduler=model.name)
    return FleetSpec((pool,), router=routing).check()


def simulate_pool(
    trace: Trace,
    make_scheduler: Callable[[], SchedulerBase],
    cost: CostModel,
    *,
    num_replicas: int,
    routing: str = "least_outstanding",
    keep_timelines: bool = True,
) -> SimResult:
    """Replay `trace` on `num_replicas` replicas behind `routing`; one result over all of them."""
    fleet = pool_fleet(make_scheduler, cost, num_replicas, routing)
    result = simulate_cluster(trace, fleet, keep_timelines=keep_timelines)
    return result.as_sim_result(f"{fleet.pools[0].scheduler} x{num_replicas}")
