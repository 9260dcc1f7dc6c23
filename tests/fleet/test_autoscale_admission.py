"""Autoscaling (the decision rule alone, and whole runs: provisioning delay, cooldowns, draining
without dropping, replica-seconds and cost) and the gateway's admission stage (token buckets,
per-tenant rates, the queue bound)."""

from __future__ import annotations

import pytest

from contbatch.core import FinishReason, SchedulerConfig
from contbatch.sim.autoscale import AutoscaleConfig, Autoscaler
from contbatch.sim.cluster import simulate_cluster
from contbatch.sim.cluster_admission import AdmissionStage
from contbatch.sim.cluster_config import AdmissionConfig, FleetSpec, PoolSpec
from contbatch.sim.cost import AffineCost
from contbatch.traces import Trace, TraceRequest

from .conftest import check_all

COST = AffineCost(base_ms=50, decode_ms=5)
CONFIG = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=4)


def test_decide_follows_the_target_and_the_cooldowns() -> None:
    scaler = Autoscaler(AutoscaleConfig(target=4, max_replicas=10, scale_up_cooldown=5, scale_down_cooldown=20))
    up = scaler.decide(0.0, [8.0, 8.0], 2, 0)
    assert (up.desired, up.change, up.observed) == (4, 2, 8.0)
    assert scaler.decide(1.0, [12.0] * 2, 2, 2).change == 0  # cooldown
    assert scaler.decide(6.0, [12.0] * 2, 2, 2).change == 2  # 6 wanted, 4 there
    assert scaler.decide(7.0, [4.2] * 6, 6, 0).change == 0  # within the tolerance
    assert scaler.decide(10.0, [1.0] * 6, 6, 0).change == 0  # down: cooldown since the last change (6.0)
    down = scaler.decide(30.0, [1.0] * 6, 6, 0)
    assert (down.desired, down.change) == (2, -4)
    assert scaler.decide(100.0, [0.0], 1, 0).desired == 1  # never below min_replicas


def test_provisioning_replicas_count_while_scaling_up() -> None:
    scaler = Autoscaler(AutoscaleConfig(target=4, max_replicas=10))
    assert scaler.decide(0.0, [8.0, 8.0], 2, 2).change == 0  # 4 wanted, 2 ready + 2 coming


def burst() -> Trace:
    quiet = [TraceRequest(f"a{i}", 2.0 * i, 100, 20) for i in range(10)]
    busy = [TraceRequest(f"b{i}", 20.0 + 0.05 * i, 100, 20) for i in range(200)]
    tail = [TraceRequest(f"c{i}", 40.0 + 2.0 * i, 100, 20) for i in range(20)]
    return Trace("burst", (*quiet, *busy, *tail), "s", "test")


def test_a_burst_scales_up_then_drains_down_without_dropping() -> None:
    scale = AutoscaleConfig(metric="in_flight", target=4, interval=1.0, provisioning_delay=3.0,
                            scale_down_cooldown=5.0, max_replicas=6)  # fmt: skip
    pool = PoolSpec("m", COST, CONFIG, 1, autoscale=scale, price_per_hour=3.6)
    result = simulate_cluster(burst(), FleetSpec((pool,)), inspect=check_all, sample_interval=1.0)
    assert all(t.finish_reason is FinishReason.LENGTH for t in result.timelines)
    ups = [e for e in result.scale_events if e.change > 0]
    downs = [e for e in result.scale_events if e.change < 0]
    assert ups and downs and ups[0].ts < downs[-1].ts
    assert max(p.num_ready for p in result.pool_series) > 1
    added = [r for r in result.replicas if r.replica_id != "m-0"]
    assert all(r.ready_ts is None or r.ready_ts - r.start_ts == pytest.approx(3.0) for r in added)
    assert result.cost == pytest.approx(result.replica_seconds / 3600 * 3.6)
    assert result.pool_series[-1].num_ready + result.pool_series[-1].num_draining <= 6
    assert {p.replica_id for p in result.load_series} == {r.replica_id for r in result.replicas}


def test_an_idle_fleet_bills_only_its_minimum() -> None:
    scale = AutoscaleConfig(target=4, interval=1.0, max_replicas=4)
    pool = PoolSpec("m", COST, CONFIG, 1, autoscale=scale, price_per_hour=1.0)
    trace = Trace("t", tuple(TraceRequest(f"r{i}", 5.0 * i, 50, 5) for i in range(6)), "s", "test")
    result = simulate_cluster(trace, FleetSpec((pool,)), inspect=check_all)
    assert len(result.replicas) == 1 and not result.scale_events
    assert result.replica_seconds == pytest.approx(result.end_ts - result.start_ts)


def test_token_bucket_spaces_admissions() -> None:
    stage = AdmissionStage(AdmissionConfig(rate=2.0, burst=1.0), 0.0)
    for i in range(4):
        assert stage.offer(TraceRequest(f"r{i}", 0.0, 10, 1), 0.0)
    assert [s.request_id for s in stage.release(0.0)] == ["r0"]
    assert stage.next_ready_ts(0.0) == pytest.approx(0.5)
    assert [s.request_id for s in stage.release(0.5)] == ["r1"]
    assert [s.request_id for s in stage.release(1.5)] == ["r2"]  # the bucket holds at most one token
    assert stage.num_queued == 1


def test_tenant_rates_do_not_hold_up_other_tenants() -> None:
    stage = AdmissionStage(AdmissionConfig(tenant_rates=(("slow", 1.0),)), 0.0)
    for i, tenant in enumerate(["slow", "slow", "fast", "fast"]):
        stage.offer(TraceRequest(f"r{i}", 0.1 * i, 10, 1, tenant=tenant), 0.3)
    assert [s.request_id for s in stage.release(0.3)] == ["r0", "r2", "r3"]
    assert stage.next_ready_ts(0.3) == pytest.approx(1.3)


def test_the_queue_bound_rejects_at_the_gateway() -> None:
    admission = AdmissionConfig(max_queue=2, rate=1.0)
    trace = Trace("t", tuple(TraceRequest(f"r{i}", 0.0, 20, 2) for i in range(5)), "s", "test")
    result = simulate_cluster(trace, FleetSpec((PoolSpec("m", COST, CONFIG, 1),), admission=admission),
                              inspect=check_all)  # fmt: skip
    reasons = [t.finish_reason for t in result.timelines]
    assert reasons.count(FinishReason.REJECTED) == 2 and result.gateway["num_gateway_rejected"] == 2
    starts = sorted(t.scheduled_ts[0] for t in result.timelines if t.scheduled_ts)
    assert starts == pytest.approx([0.0, 1.0, 2.0])  # one a second: the global rate


def test_max_in_flight_holds_requests_at_the_gateway_for_new_replicas() -> None:
    """Flow control: a burst waits at the gateway, not in the first replica's queue, so replicas the
    autoscaler adds take it."""
    scale = AutoscaleConfig(metric="queue_length", target=1, interval=0.5, provisioning_delay=1.0, max_replicas=4)
    pool = PoolSpec("m", COST, CONFIG, 1, autoscale=scale)
    trace = Trace("b", tuple(TraceRequest(f"r{i}", 0.01 * i, 64, 20) for i in range(80)), "s", "test")
    gated = FleetSpec((pool,), admission=AdmissionConfig(max_in_flight=4))
    result = simulate_cluster(trace, gated, inspect=check_all)
    routed = [r.num_routed for r in result.replicas]
    assert len(routed) > 1 and min(routed) > 0  # the added replicas took part of the burst
    assert result.gateway["max_gateway_queue"] > 40
    assert all(t.finish_reason is FinishReason.LENGTH for t in result.timelines)
