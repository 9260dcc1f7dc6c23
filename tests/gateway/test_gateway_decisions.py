"""The gateway decides as the simulator does, given the same observations.

A cluster simulation is run with its router's `choose` and its `LoadTracker`'s calls recorded:
every decision (the request, the views the router saw, the replica it chose) and every
`routed`, `first_token`, `tokens` and `finished` in order. The same calls are then replayed into
the gateway's `Balancer` (the scrapes the simulator let its router see are fed as the gateway's
monitor feeds them, `Balancer.scraped`): at every decision the gateway's views equal the
simulator's and it chooses the same replica, for every router of the registry, stale scrapes
and a heterogeneous fleet priced by cost model included. The gateway imports the router classes
from `contbatch.routing`, the module the simulator uses (checked too).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

import contbatch.gateway.balancer as gateway_balancer
import contbatch.sim.cluster as sim_cluster
from contbatch.core import PRESETS
from contbatch.core.config import KVConfig
from contbatch.gateway import Balancer
from contbatch.routing import LoadTracker, ReplicaView, Router, RouteRequest, make_router
from contbatch.sim import parse_cost
from contbatch.sim.cluster import ClusterSim
from contbatch.sim.cluster_config import FleetSpec, PoolSpec, aggregated
from contbatch.sim.cluster_pricing import work_pricer
from contbatch.traces import Trace, load_trace
from contbatch.traces.synthetic import scale_to_rate

CONFIG = dataclasses.replace(PRESETS["engine"], kv=KVConfig(block_size=16, num_blocks=600, enable_prefix_caching=True))
COST = parse_cost("affine")

Event = tuple[Any, ...]


def _trace(name: str, rate: float, n: int) -> Trace:
    trace = scale_to_rate(load_trace(name), rate)
    return dataclasses.replace(trace, requests=trace.requests[:n])


def record(sim: ClusterSim) -> list[Event]:
    """Wrap the aggregated fleet's router and tracker: the decisions and tracker calls, in order."""
    group = sim.groups["mixed"]
    tracker: LoadTracker = group.tracker
    router: Router = group.router
    events: list[Event] = []
    choose, routed = router.choose, tracker.routed

    def recording_choose(request: RouteRequest, views: list[ReplicaView]) -> int:
        seen = [copy.copy(v) for v in views]
        index = choose(request, views)
        events.append(("route", request, seen, views[index].replica_id))
        return index

    def recording_routed(request: RouteRequest, replica_id: str) -> None:
        assert events[-1][0] == "route" and events[-1][1] is request and events[-1][3] == replica_id
        routed(request, replica_id)

    def wrap(name: str) -> None:
        method = getattr(tracker, name)

        def call(*args: Any) -> Any:
            events.append((name, *args))
            return method(*args)

        setattr(tracker, name, call)

    router.choose = recording_choose  # type: ignore[method-assign]
    tracker.routed = recording_routed  # type: ignore[method-assign]
    for name in ("first_token", "tokens", "finished"):
        wrap(name)
    return events


def replay(events: list[Event], balancer: Balancer) -> int:
    """Feed the recorded calls to the gateway's balancer; the number of decisions checked."""
    decisions = 0
    for event in events:
        kind = event[0]
        if kind == "route":
            _, request, seen, chosen = event
            for view in seen:  # the scrapes the simulator's router saw, as the monitor would feed them
                balancer.scraped(view.replica_id, view.scrape)
            assert balancer.views() == seen, f"views differ before {request.request_id}"
            assert balancer.route(request) == chosen, f"{request.request_id}: the gateway chose differently"
            decisions += 1
        elif kind == "first_token":
            balancer.first_token(event[1])
        elif kind == "tokens":
            balancer.tokens(event[1], event[2])
        else:
            balancer.finished(event[1])
        balancer.tracker.check()
    assert balancer.tracker.num_in_flight == 0
    return decisions


CASES = [
    ("round_robin", 0.0),
    ("least_outstanding", 0.0),
    ("least_kv", 0.0),
    ("least_kv", 0.5),  # scrapes half a second old
    ("least_work", 0.0),
    ("prefix_affinity", 0.0),
    ("prefix_affinity:load=1.1,vnodes=16,blocks=4", 0.0),
    ("weighted:prefix=2,queue=1,kv=1", 0.25),
    ("weighted:load=1,work=2", 0.0),
]


@pytest.mark.parametrize(("spec", "signal_delay"), CASES)
def test_the_gateway_replays_the_simulators_decisions(spec: str, signal_delay: float) -> None:
    trace = _trace("prefix-share", 30.0, 150)
    fleet = dataclasses.replace(aggregated(COST, CONFIG, 4, router=spec), signal_delay=signal_delay)
    sim = ClusterSim(trace, fleet)
    events = record(sim)
    sim.run()
    ids = [r.replica_id for r in sim.replicas]
    balancer = Balancer(spec, ids, pricer=work_pricer(sim.pricers))
    assert replay(events, balancer) == len(trace.requests)
    chosen = {e[3] for e in events if e[0] == "route"}
    assert len(chosen) > 1  # the decisions spread over the fleet: the replay is not trivial


def test_a_heterogeneous_fleet_priced_by_cost_model() -> None:
    """`least_work` prices each replica's work with its own cost model in the simulator; handed
    the same pricer, the gateway decides the same."""
    fast = PoolSpec("fast", parse_cost("roofline:llama-2-7b@h100"), PRESETS["engine"], 2)
    slow = PoolSpec("slow", parse_cost("roofline:llama-2-7b@a100"), PRESETS["engine"], 2)
    sim = ClusterSim(_trace("azure-code", 8.0, 150), FleetSpec((fast, slow), router="least_work"))
    events = record(sim)
    sim.run()
    balancer = Balancer("least_work", [r.replica_id for r in sim.replicas], pricer=work_pricer(sim.pricers))
    assert replay(events, balancer) == 150


def test_a_backend_out_of_the_rotation_is_offered_to_no_router() -> None:
    balancer = Balancer("round_robin", ["a", "b", "c"])
    request = RouteRequest("r", 10, 10)
    balancer.set_healthy("b", False)
    picks = [balancer.choose(request) for _ in range(4)]
    assert picks == ["a", "c", "a", "c"]
    assert balancer.choose(request, exclude=["a", "c"]) is None
    balancer.set_healthy("b", True)
    assert [v.replica_id for v in balancer.views()] == ["a", "b", "c"]


def test_one_routing_module() -> None:
    """The gateway and the simulator build their routers from the same registry function."""
    assert gateway_balancer.make_router is sim_cluster.make_router is make_router
    assert type(Balancer("least_outstanding", ["a"]).router) is type(make_router("least_outstanding"))
