"""The cluster simulator's records over time and its result: replica counts per pool at every
change, each replica's load and KV usage at every sample, the autoscaler's changes, and at the
end one `ReplicaReport` per replica and the `ClusterResult`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from contbatch.core.timeline import Timeline
from contbatch.sim.autoscale import Decision
from contbatch.sim.cluster_config import PoolSpec
from contbatch.sim.cluster_replica import Replica, ReplicaState
from contbatch.sim.cluster_result import (
    ClusterResult,
    LoadPoint,
    PoolPoint,
    ReplicaReport,
    ScaleEvent,
    summed_stats,
)
from contbatch.sim.cluster_transfer import TransferStats

if TYPE_CHECKING:
    from contbatch.sim.cluster import ClusterSim


class Reporter:
    def __init__(self, sim: ClusterSim, sample_interval: float | None) -> None:
        if sample_interval is not None and not sample_interval > 0:
            raise ValueError(f"sample_interval must be > 0, got {sample_interval}")
        self.sim = sim
        self.sample_interval = sample_interval
        self.load: list[LoadPoint] = []
        self.pools: list[PoolPoint] = []
        self.scales: list[ScaleEvent] = []
        if sample_interval is not None:
            from contbatch.sim.cluster import SAMPLE

            sim._push(sim.start_ts, SAMPLE, None)

    def pool_changed(self, pool: PoolSpec, now: float) -> None:
        counts = {state: 0 for state in ReplicaState}
        for replica in self.sim.replicas:
            if replica.pool is pool:
                counts[replica.state] += 1
        point = PoolPoint(now, pool.name, counts[ReplicaState.READY], counts[ReplicaState.PROVISIONING],
                          counts[ReplicaState.DRAINING])  # fmt: skip
        if self.pools and self.pools[-1].ts == now and self.pools[-1].pool == pool.name:
            self.pools[-1] = point
        else:
            self.pools.append(point)

    def scaled(self, pool: PoolSpec, now: float, decision: Decision) -> None:
        self.scales.append(ScaleEvent(now, pool.name, decision.change, decision.desired, decision.observed))

    def sample(self, now: float) -> None:
        from contbatch.sim.cluster import SAMPLE

        for replica in self.sim.replicas:
            if replica.state is not ReplicaState.STOPPED:
                s = replica.scrape(now)
                self.load.append(LoadPoint(now, replica.replica_id, replica.pool.name, replica.state.value,
                                           s.num_running, s.num_waiting, s.kv_usage))  # fmt: skip
        if self.sim.active and self.sample_interval is not None:
            self.sim._push(now + self.sample_interval, SAMPLE, None)

    def result(self) -> ClusterResult:
        sim = self.sim
        end = sim.end_ts
        for pool in sim.fleet.pools:
            self.pool_changed(pool, end)
        timelines: tuple[Timeline, ...] = ()
        if sim.timelines is not None:
            timelines = tuple(sim.timelines[r.request_id] for r in sim.trace.requests)
        gateway: dict[str, object] = {"num_gateway_rejected": sim.num_gateway_rejected}
        if sim.admission is not None:
            gateway["max_gateway_queue"] = sim.admission.max_queued
        link = sim.link.stats if sim.link is not None else TransferStats()  # (zeros when aggregated)
        transfers = {"num_disaggregated": sim.num_disaggregated, "num_decode_only": sim.num_decode_only,
                     **link.as_dict()}  # fmt: skip
        return ClusterResult(
            time_unit=sim.fleet.time_unit,
            timelines=timelines,
            replicas=tuple(_report(r, end) for r in sim.replicas),
            start_ts=sim.start_ts,
            end_ts=end,
            streaming=sim.streaming,
            gateway=gateway,
            transfers=transfers,
            load_series=tuple(self.load),
            pool_series=tuple(self.pools),
            scale_events=tuple(self.scales),
            scheduler_stats=summed_stats([r.scheduler.stats.as_dict() for r in sim.replicas]),
        )


def _report(replica: Replica, end: float) -> ReplicaReport:
    totals, stats = replica.core.totals, replica.scheduler.stats
    stop = replica.stop_ts if replica.stop_ts is not None else max(end, replica.start_ts)
    return ReplicaReport(
        replica_id=replica.replica_id,
        pool=replica.pool.name,
        role=replica.pool.role,
        start_ts=replica.start_ts,
        ready_ts=replica.ready_ts,
        stop_ts=stop,
        num_devices=replica.pool.num_devices,
        price_per_hour=replica.pool.price_per_hour,
        num_routed=replica.num_routed,
        num_steps=totals.num_steps,
        busy_time=totals.busy_time,
        kv_usage_mean=totals.kv_usage_mean,
        kv_usage_max=totals.kv_max,
        num_preemptions=stats.num_preemptions,
        padding_tokens=totals.num_padding_tokens,
        unsent_tokens=stats.num_unsent_tokens,
    )
