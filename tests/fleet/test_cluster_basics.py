"""The cluster simulator against what it must reproduce: one replica behind any router is the
single-replica simulator (same timelines), the pool of `capacity` is a fleet, heterogeneous pools
share one router, routers see delayed scrapes, and the streaming mode gives the same summary."""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.core import PRESETS, ContinuousScheduler, SchedulerConfig, make_scheduler
from contbatch.core.config import KVConfig
from contbatch.metrics import SLO
from contbatch.sim import parse_cost, simulate
from contbatch.sim.cluster import ClusterSim, simulate_cluster
from contbatch.sim.cluster_config import FleetError, FleetSpec, PoolSpec, aggregated
from contbatch.sim.pool import simulate_pool
from contbatch.traces import Trace, TraceRequest, load_trace
from contbatch.traces.synthetic import scale_to_rate

from .conftest import check_all

CONFIG = dataclasses.replace(PRESETS["engine"], kv=KVConfig(block_size=16, num_blocks=400, enable_prefix_caching=True))
COST = parse_cost("affine")


def _small(name: str, rate: float, n: int = 120) -> Trace:
    trace = scale_to_rate(load_trace(name), rate)
    return dataclasses.replace(trace, requests=trace.requests[:n])


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding", "prefix_affinity", "least_work"])
def test_one_replica_is_the_single_replica_simulator(router: str) -> None:
    trace = _small("prefix-share", 12.0, 60)
    alone = simulate(trace, ContinuousScheduler(CONFIG), COST)
    fleet = simulate_cluster(trace, aggregated(COST, CONFIG, 1, router=router), inspect=check_all)
    assert [t.token_ts for t in fleet.timelines] == [t.token_ts for t in alone.timelines]
    assert [t.scheduled_ts for t in fleet.timelines] == [t.scheduled_ts for t in alone.timelines]
    assert fleet.summary() == {**alone.summary(), **fleet.fleet_stats(fleet.summary())}


def test_the_pool_wrapper_is_a_fleet() -> None:
    trace = _small("azure-code", 6.0, 200)
    pooled = simulate_pool(trace, lambda: make_scheduler("continuous", CONFIG), COST, num_replicas=3)
    fleet = simulate_cluster(trace, aggregated(COST, CONFIG, 3))
    assert [t.token_ts for t in pooled.timelines] == [t.token_ts for t in fleet.timelines]
    assert pooled.num_steps == sum(r.num_steps for r in fleet.replicas)


def test_routers_differ_and_prefix_affinity_wins_on_shared_prefixes() -> None:
    trace = _small("prefix-share", 40.0, 300)
    slo = SLO(ttft=0.5)
    hits = {}
    for router in ("round_robin", "prefix_affinity"):
        result = simulate_cluster(trace, aggregated(COST, CONFIG, 4, router=router))
        hits[router] = result.summary(slo)["mean_ttft_ms"]
    assert hits["prefix_affinity"] < hits["round_robin"]


def test_heterogeneous_pools_share_one_router() -> None:
    fast = PoolSpec("fast", parse_cost("roofline:llama-2-7b@h100"), PRESETS["engine"], 2)
    slow = PoolSpec("slow", parse_cost("roofline:llama-2-7b@a100"), PRESETS["engine"], 2)
    trace = _small("azure-code", 8.0, 200)
    result = simulate_cluster(trace, FleetSpec((fast, slow), router="least_work"))
    routed = {r.replica_id: r.num_routed for r in result.replicas}
    assert sum(routed.values()) == 200
    assert routed["fast-0"] + routed["fast-1"] > routed["slow-0"] + routed["slow-1"]


def test_signal_delay_feeds_old_scrapes() -> None:
    trace = _small("azure-code", 8.0, 150)
    seen: list[float] = []

    def spy(sim: ClusterSim, replica: object) -> None:
        for view in sim.groups["mixed"].views:
            if view.scrape is not None:
                seen.append(view.scrape.ts)

    fleet = dataclasses.replace(aggregated(COST, PRESETS["engine"], 3, router="least_kv"), signal_delay=2.0)
    fresh = simulate_cluster(trace, aggregated(COST, PRESETS["engine"], 3, router="least_kv"))
    stale = simulate_cluster(trace, fleet, inspect=spy)
    assert seen and max(seen) <= trace.requests[-1].arrival_ts - 2.0 + 1e-9
    assert [t.token_ts for t in stale.timelines] != [t.token_ts for t in fresh.timelines]


def test_streaming_mode_gives_the_same_summary() -> None:
    trace = _small("azure-code", 8.0, 150)
    fleet = aggregated(COST, PRESETS["engine"], 3)
    slo = SLO(ttft=1.0, tpot=0.05)
    kept = simulate_cluster(trace, fleet).summary(slo)
    folded = simulate_cluster(trace, fleet, keep_timelines=False).summary(slo)
    assert folded == kept


def test_bad_fleets_are_named() -> None:
    pool = PoolSpec("p", COST, PRESETS["engine"], 1, role="prefill")
    with pytest.raises(FleetError, match="both a prefill and a decode pool"):
        FleetSpec((pool,)).check()
    with pytest.raises(FleetError, match="unknown router"):
        FleetSpec((PoolSpec("m", COST, PRESETS["engine"]),), router="best").check()
    with pytest.raises(FleetError, match="one clock"):
        ticking = PoolSpec("b", parse_cost("unit:8"), PRESETS["engine"])
        FleetSpec((PoolSpec("a", COST, PRESETS["engine"]), ticking)).check()
    ticks = Trace("t", (TraceRequest("a", 0.0, 4, 4),), "tick", "test")
    with pytest.raises(ValueError, match="timed in tick"):
        simulate_cluster(ticks, aggregated(COST, PRESETS["engine"], 1))
    cancel = Trace("c", (TraceRequest("a", 0.0, 4, 4, cancel_ts=1.0),), "s", "test")
    with pytest.raises(ValueError, match="cancellations"):
        simulate_cluster(cancel, aggregated(COST, PRESETS["engine"], 1))


def test_rejections_end_requests_once() -> None:
    tight = SchedulerConfig(max_num_batched_tokens=64, max_model_len=100)
    trace = Trace("r", tuple(TraceRequest(f"r{i}", i * 0.1, 60 + 20 * i, 20) for i in range(5)), "s", "test")
    result = simulate_cluster(trace, aggregated(COST, tight, 2), inspect=check_all)
    reasons = [t.finish_reason.value for t in result.timelines if t.finish_reason is not None]
    assert reasons == ["length", "length", "rejected", "rejected", "rejected"]  # prompt + 20 > max_model_len 100
