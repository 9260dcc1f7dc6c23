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
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.core.request import Request
from contbatch.sim.cost import CostModel
from contbatch.sim.executor import SimExecutor
from contbatch.sim.loop import SimResult, make_request
from contbatch.traces import Trace

ROUTINGS = ("round_robin", "least_outstanding")


@dataclass(slots=True)
class _Replica:
    scheduler: SchedulerBase
    executor: SimExecutor
    step: tuple[SchedulerOutput, StepResult] | None = None
    num_steps: int = 0
    busy: float = 0.0
    padding: int = 0


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
    replicas = [_Replica(make_scheduler(), SimExecutor(stops)) for _ in range(num_replicas)]
    kv = replicas[0].scheduler.config.kv
    requests = [make_request(spec, kv.block_size if kv is not None else None) for spec in specs]
    # (time, kind, index): kind 0 = replica `index` ends a step, kind 1 = request `index` arrives
    events: list[tuple[float, int, int]] = [(r.arrival_ts, 1, i) for i, r in enumerate(requests)]
    heapq.heapify(events)
    turn = 0
    while events:
        now, kind, index = heapq.heappop(events)
        if kind == 0:
            _end_step(replicas[index], now)
        else:
            target = turn if routing == "round_robin" else _least_outstanding(replicas)
            turn = (turn + 1) % num_replicas
            replicas[target].scheduler.add_request(requests[index], now)
            index = target
        replica = replicas[index]
        if replica.step is None and replica.scheduler.has_unfinished():
            _start_step(replica, index, now, cost, events)
    if any(r.scheduler.has_unfinished() for r in replicas):
        raise RuntimeError("a replica stopped with work pending (a scheduler that scheduled nothing)")
    return _result(replicas, requests, cost)


def _least_outstanding(replicas: list[_Replica]) -> int:
    return min(range(len(replicas)), key=lambda i: (len(replicas[i].scheduler.requests), i))


def _start_step(
    replica: _Replica, index: int, now: float, cost: CostModel, events: list[tuple[float, int, int]]
) -> None:
    out = replica.scheduler.schedule(now)
    if out.is_empty:
        return  # waits for the next arrival routed here
    duration = cost.step_time(out)
    replica.step = (out, replica.executor.execute(out))
    replica.num_steps += 1
    replica.busy += duration
    replica.padding += out.num_padding_tokens
    heapq.heappush(events, (now + duration, 0, index))


def _end_step(replica: _Replica, now: float) -> None:
    assert replica.step is not None
    out, result = replica.step
    replica.step = None
    replica.scheduler.update(out, result, now)


def _result(replicas: list[_Replica], requests: list[Request], cost: CostModel) -> SimResult:
    stats: dict[str, object] = {}
    for replica in replicas:
        for key, value in replica.scheduler.stats.as_dict().items():
            if isinstance(value, int | float) and not isinstance(value, bool) and not key.endswith("_rate"):
                stats[key] = stats.get(key, 0) + value  # type: ignore[operator]
    return SimResult(
        scheduler=f"{replicas[0].scheduler.name} x{len(replicas)}",
        time_unit=cost.time_unit,
        timelines=tuple(r.timeline for r in requests),
        num_steps=sum(r.num_steps for r in replicas),
        padding_tokens=sum(r.padding for r in replicas),
        busy_time=sum(r.busy for r in replicas),
        scheduler_stats=stats,
    )
