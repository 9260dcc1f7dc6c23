"""Decode runs inside a fleet (`contbatch.sim.cluster_runs`) give exactly what stepping gives:
the same timelines and finish reasons, the same steps, busy time and KV figures per replica, the
same autoscaling decisions, on random fleets and traces; invariants hold after every event."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings

from contbatch.core import PRESETS
from contbatch.sim import parse_cost
from contbatch.sim.cluster import ClusterSim, simulate_cluster
from contbatch.sim.cluster_config import FleetSpec, aggregated
from contbatch.sim.cluster_replica import Replica
from contbatch.sim.cluster_result import ClusterResult
from contbatch.traces import Trace, load_trace
from contbatch.traces.synthetic import scale_to_rate

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
