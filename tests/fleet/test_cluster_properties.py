"""Whole fleets on random traces: aggregated (homogeneous or heterogeneous), disaggregated, with
a gateway admission stage, signal delays and autoscaling, every router. After every event the
fleet's accounting and (between steps) every replica's scheduler invariants are checked
(`conftest.check_all`). At the end every request ended exactly once, with one reason; requests
that ran produced their output length; no replica holds a block; and a run is deterministic."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.core import FinishReason, SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.sim.autoscale import AutoscaleConfig
from contbatch.sim.cluster import simulate_cluster
from contbatch.sim.cluster_config import AdmissionConfig, DisaggConfig, FleetSpec, LinkConfig, PoolSpec
from contbatch.sim.cluster_result import ClusterResult
from contbatch.sim.cost import AffineCost
from contbatch.traces import Trace, TraceRequest

from .conftest import check_all

ROUTER_SPECS = [
    "round_robin",
    "least_outstanding",
    "least_kv",
    "least_work",
    "prefix_affinity",
    "prefix_affinity:load=1,blocks=1",
    "weighted:prefix=2,queue=1,kv=1,load=1,work=1",
]


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    rows = draw(
        st.lists(
            st.tuples(
                st.floats(0.0, 8.0, allow_nan=False),
                st.integers(1, 120),
                st.integers(1, 12),
                st.sampled_from([None, "g0", "g1"]),
                st.sampled_from([None, "t0", "t1"]),
                st.booleans(),
            ),
            min_size=1,
            max_size=24,
        )
    )
    rows.sort(key=lambda r: r[0])
    requests = []
    for i, (ts, prompt, out, group, tenant, early) in enumerate(rows):
        prefix = min(prompt, 32) if group else 0
        limit = out + 3 if early else None
        requests.append(TraceRequest(f"r{i}", ts, prompt, out, max_output_tokens=limit, prefix_group=group,
                                     prefix_tokens=prefix, tenant=tenant))  # fmt: skip
    return Trace("gen", tuple(requests), "s", "hypothesis")


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    kv = None
    if draw(st.booleans()):
        kv = KVConfig(
            block_size=draw(st.sampled_from([4, 8, 16])),
            num_blocks=draw(st.integers(6, 64)),
            watermark=0.0,
            enable_prefix_caching=draw(st.booleans()),
            admission=draw(st.sampled_from(["reserve", "optimistic", "estimate"])),
            preemption=draw(st.sampled_from(["recompute", "swap"])),
            num_host_blocks=32,
        )
    return SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(16, 160)),
        max_num_seqs=draw(st.none() | st.integers(1, 6)),
        chunked_prefill=draw(st.booleans()),
        sample_on_prefill=draw(st.booleans()),
        kv=kv,
    )


# slow replicas (tens to hundreds of ms a step), so that 24 requests in 8 s contend
costs = st.sampled_from([AffineCost(base_ms=50, prefill_ms=5, decode_ms=5), AffineCost(base_ms=200, prefill_ms=20)])


@st.composite
def autoscaling(draw: st.DrawFn) -> AutoscaleConfig | None:
    if not draw(st.booleans()):
        return None
    return AutoscaleConfig(
        metric=draw(st.sampled_from(["kv_usage", "queue_length", "in_flight"])),
        target=draw(st.sampled_from([0.3, 1.0, 3.0])),
        interval=draw(st.sampled_from([0.5, 2.0])),
        scrape_delay=draw(st.sampled_from([0.0, 0.7])),
        provisioning_delay=draw(st.sampled_from([0.0, 1.5])),
        scale_up_cooldown=draw(st.sampled_from([0.0, 1.0])),
        scale_down_cooldown=draw(st.sampled_from([0.0, 3.0])),
        min_replicas=1,
        max_replicas=draw(st.integers(1, 4)),
    )


@st.composite
def pools(draw: st.DrawFn, role: str, name: str) -> PoolSpec:
    scale = draw(autoscaling())
    count = draw(st.integers(1, 3))
    if scale is not None:
        count = min(count, scale.max_replicas)
    return PoolSpec(name, draw(costs), draw(configs()), count, role=role, autoscale=scale, price_per_hour=2.0)


@st.composite
def fleets(draw: st.DrawFn) -> FleetSpec:
    admission = AdmissionConfig()
    if draw(st.booleans()):
        admission = AdmissionConfig(
            max_queue=draw(st.none() | st.integers(0, 5)),
            rate=draw(st.none() | st.sampled_from([0.5, 2.0])),
            burst=draw(st.sampled_from([1.0, 3.0])),
            tenant_rates=draw(st.sampled_from([(), (("t0", 0.4),)])),
            max_in_flight=draw(st.none() | st.integers(1, 4)),
        )
    router = draw(st.sampled_from(ROUTER_SPECS))
    delay = draw(st.sampled_from([0.0, 0.3]))
    if draw(st.booleans()):
        mixed = tuple(draw(pools("mixed", f"m{i}")) for i in range(draw(st.integers(1, 2))))
        return FleetSpec(mixed, router=router, admission=admission, signal_delay=delay)
    link = LinkConfig(bandwidth=draw(st.sampled_from([1e3, 1e6])), latency=0.01, kv_bytes_per_token=64.0)
    disagg = DisaggConfig(threshold=draw(st.sampled_from([0, 40])), link=link)
    return FleetSpec(
        (draw(pools("prefill", "p")), draw(pools("decode", "d"))),
        router=router,
        prefill_router=draw(st.sampled_from(ROUTER_SPECS)),
        admission=admission,
        disagg=disagg,
        signal_delay=delay,
    )


def _signature(result: ClusterResult) -> list[tuple[object, ...]]:
    return [(t.request_id, t.finish_reason, tuple(t.token_ts), tuple(t.scheduled_ts)) for t in result.timelines]


@settings(max_examples=3 * settings().max_examples)
@given(traces(), fleets())
def test_every_request_ends_once_and_nothing_leaks(trace: Trace, fleet: FleetSpec) -> None:
    result = simulate_cluster(trace, fleet, inspect=check_all)
    assert [t.request_id for t in result.timelines] == [r.request_id for r in trace.requests]
    for spec, tl in zip(trace.requests, result.timelines, strict=True):
        assert tl.finish_reason is not None
        if tl.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
            assert tl.num_output_tokens == spec.num_output_tokens
            assert tl.first_token_ts is not None and tl.first_token_ts >= spec.arrival_ts
    assert all(r.stop_ts >= r.start_ts for r in result.replicas)
    assert result.replica_seconds >= 0 and result.cost is not None
    again = simulate_cluster(trace, fleet)
    assert _signature(again) == _signature(result)
