"""Decode runs inside a fleet (`contbatch.sim.cluster_runs`) give exactly what stepping gives:
the same timelines and finish reasons, the same steps, busy time and KV figures per replica, the
same autoscaling decisions, on random fleets and traces; invariants hold after every event."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings

from contbatch.core import PRESETS, SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.sim import parse_cost
from contbatch.sim.cluster import ClusterSim, simulate_cluster
from contbatch.sim.cluster_config import FleetSpec, aggregated
from contbatch.sim.cluster_replica import Replica
from contbatch.sim.cluster_result import ClusterResult
from contbatch.traces import Trace, load_trace
from contbatch.traces.synthetic import fixed, generate, poisson, scale_to_rate, uniform

from .conftest import check_all
from .test_cluster_properties import fleets, traces


def signature(result: ClusterResult) -> tuple[object, ...]:
    timelines = [
        (t.request_id, t.finish_reason, t.token_ts, t.token_counts, t.scheduled_ts, t.preempted_ts, t.finished_ts)
        for t in result.timelines
    ]
    replicas = [(r.replica_id, r.num_steps, r.busy_time, r.kv_usage_max, r.num_preemptions) for r in result.replicas]
    return timelines, replicas, result.scale_events, result.pool_series


@settings(max_examples=2 * settings().max_examples)
@given(traces(), fleets())
def test_runs_equal_stepping(trace: Trace, fleet: FleetSpec) -> None:
    stepped = simulate_cluster(trace, fleet, decode_runs=False)
    assert signature(simulate_cluster(trace, fleet, inspect=check_all)) == signature(stepped)


def test_runs_are_taken_and_equal_stepping_on_a_real_trace() -> None:
    trace = scale_to_rate(load_trace("azure-code"), 20.0)
    trace = dataclasses.replace(trace, requests=trace.requests[:400])
    fleet = aggregated(parse_cost("roofline:llama-2-7b@a100"), PRESETS["engine"], 4)
    taken = []

    def count(sim: ClusterSim, replica: Replica | None) -> None:
        taken.extend(r.run.num_steps for r in sim.replicas if r.run is not None)

    with_runs = simulate_cluster(trace, fleet, inspect=count)
    assert max(taken) > 5  # runs were taken, and long
    stepped = simulate_cluster(trace, fleet, decode_runs=False)
    assert signature(with_runs) == signature(stepped)
    assert with_runs.summary() == stepped.summary()


def test_runs_take_swaps_in_a_fleet_and_equal_stepping() -> None:
    """Two replicas whose pools are too small for the load, preempting by swap: the runs take
    the swaps out and back in (far fewer runs than swaps), with stepping's results."""
    trace = generate("tight", 240, poisson(40.0), fixed(64), uniform(40, 200), seed=5)
    kv = KVConfig(num_blocks=120, block_size=16, preemption="swap", num_host_blocks=60)
    config = SchedulerConfig(max_num_batched_tokens=512, kv=kv)
    fleet = aggregated(parse_cost("affine"), config, 2)
    runs: dict[int, object] = {}  # (the runs kept alive: their ids stay theirs)

    def count(sim: ClusterSim, replica: Replica | None) -> None:
        runs.update((id(r.run), r.run) for r in sim.replicas if r.run is not None)

    with_runs = simulate_cluster(trace, fleet, inspect=count)
    stepped = simulate_cluster(trace, fleet, decode_runs=False)
    assert signature(with_runs) == signature(stepped)
    swaps = stepped.scheduler_stats["num_swap_outs"]
    assert isinstance(swaps, int) and swaps > 20 and stepped.scheduler_stats["num_swap_ins"] == swaps
    assert with_runs.scheduler_stats == stepped.scheduler_stats
    assert len(runs) < swaps / 4
