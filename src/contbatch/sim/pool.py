"""A pool of replicas behind a router: each replica is its own scheduler and executor, the clock
is shared. For capacity planning ("how many replicas for this trace at this SLO").

Routing (at each arrival): `round_robin`, or `least_outstanding` (the replica with the fewest
unfinished requests; ties to the lowest index). A replica steps whenever it has work, exactly as
`simulate` does for one; events are arrivals and replica step ends, handled in time order (ties:
step ends first, then arrivals, by replica index), so a run is deterministic.

Invariant: every trace request is routed to exactly one replica and finishes there with one
finish reason; the per-request timelines are those of the replica that served it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from contbatch.core.base import SchedulerBase
from contbatch.core.request import Request
from contbatch.loop import EngineCore, Flight, VirtualClock
from contbatch.sim.cost import CostModel
from contbatch.sim.executor import SimExecutor
from contbatch.sim.loop import SimResult, make_request
from contbatch.traces import Trace

ROUTINGS = ("round_robin", "least_outstanding")


@dataclass(slots=True)
class _Replica:
    """One replica: its own step loop on its own virtual clock, moved to the shared time."""

    core: EngineCore
    clock: VirtualClock
    flight: Flight | None = None


def simulate_pool(
    trace: Trace,
    make_scheduler: Callable[[], SchedulerBase],
    cost: CostModel,
    *,
    num_replicas: int,
    routing: str = "least_outstanding",
) -> SimResult:
    """Replay `trace` on `num_replicas` replicas; one result over all of them (steps, busy time
    and padding are summed across replicas)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")
    specs = trace.requests
    stops = {s.request_id: s.num_output_tokens for s in specs if s.num_output_tokens < s.output_limit}
    replicas = [_replica(make_scheduler(), cost, stops) for _ in range(num_replicas)]
    kv = replicas[0].core.scheduler.config.kv
    requests = [make_request(spec, kv.block_size if kv is not None else None) for spec in specs]
    # (time, kind, index): kind 0 = replica `index` ends a step, kind 1 = request `index` arrives
    events: list[tuple[float, int, int]] = [(r.arrival_ts, 1, i) for i, r in enumerate(requests)]
    heapq.heapify(events)
    turn = 0
    while events:
        now, kind, index = heapq.heappop(events)
        if kind == 0:
            _end_step(replicas[index])
        else:
            target = turn if routing == "round_robin" else _least_outstanding(replicas)
            turn = (turn + 1) % num_replicas
            replicas[target].core.add_request(requests[index], at=now)
            index = target
        replica = replicas[index]
        if replica.flight is None and replica.core.has_unfinished():
            _start_step(replica, index, now, events)
    if any(r.core.has_unfinished() for r in replicas):
        raise RuntimeError("a replica stopped with work pending (a scheduler that scheduled nothing)")
    return _result(replicas, requests, cost)


def _replica(scheduler: SchedulerBase, cost: CostModel, stops: dict[str, int]) -> _Replica:
    clock = VirtualClock(cost)
    return _Replica(EngineCore(scheduler, SimExecutor(stops), clock), clock)


def _least_outstanding(replicas: list[_Replica]) -> int:
    return min(range(len(replicas)), key=lambda i: (replicas[i].core.scheduler.num_unfinished, i))


def _start_step(replica: _Replica, index: int, now: float, events: list[tuple[float, int, int]]) -> None:
    replica.clock.advance_to(now)
    replica.flight = flight = replica.core.begin_step()
    if flight is not None:  # else it waits for the next arrival routed here
        heapq.heappush(events, (flight.end_ts, 0, index))


def _end_step(replica: _Replica) -> None:
    assert replica.flight is not None
    flight, replica.flight = replica.flight, None
    replica.core.end_step(flight)


def _result(replicas: list[_Replica], requests: list[Request], cost: CostModel) -> SimResult:
    stats: dict[str, object] = {}
    for replica in replicas:
        for key, value in replica.core.scheduler.stats.as_dict().items():
            if isinstance(value, int | float) and not isinstance(value, bool) and not key.endswith("_rate"):
                stats[key] = stats.get(key, 0) + value  # type: ignore[operator]
    totals = [r.core.totals for r in replicas]
    return SimResult(
        scheduler=f"{replicas[0].core.scheduler.name} x{len(replicas)}",
        time_unit=cost.time_unit,
        timelines=tuple(r.timeline for r in requests),
        num_steps=sum(t.num_steps for t in totals),
        padding_tokens=sum(t.num_padding_tokens for t in totals),
        busy_time=sum(t.busy_time for t in totals),
        scheduler_stats=stats,
    )
