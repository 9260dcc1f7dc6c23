"""What a cluster simulation returns: the per-request timelines (or their streaming summary),
one report per replica, the fleet's cost, and what the plots draw over time.

`summary(slo)` is `contbatch.metrics.summarize` over every request of the fleet, plus the fleet
keys: replica-seconds (each replica from its request, provisioning included, to its stop or the
end of the run), device-seconds, cost (replica-hours × each pool's price; on a seconds clock
only), cost per 1,000 requests meeting the SLO, gateway rejections, KV transfers, and how many
requests were disaggregated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, StreamingSummary, summarize
from contbatch.sim.loop import SimResult


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    replica_id: str
    pool: str
    role: str
    start_ts: float  # billed from (provisioning included)
    ready_ts: float | None  # serving from (None: cancelled while provisioning)
    stop_ts: float  # stopped, or the run's end
    num_devices: int
    price_per_hour: float
    num_routed: int  # requests it took
    num_steps: int
    busy_time: float
    kv_usage_mean: float
    kv_usage_max: float
    num_preemptions: int
    padding_tokens: int
    unsent_tokens: int

    @property
    def seconds(self) -> float:
        """Billed time, in the clock's unit."""
        return self.stop_ts - self.start_ts

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__} | {"seconds": self.seconds}


class LoadPoint(NamedTuple):
    """One replica at one sample time."""

    ts: float
    replica_id: str
    pool: str
    state: str
    num_running: int
    num_waiting: int
    kv_usage: float


class PoolPoint(NamedTuple):
    """One pool's replica counts at one sample time (or at a change)."""

    ts: float
    pool: str
    num_ready: int
    num_provisioning: int
    num_draining: int


class ScaleEvent(NamedTuple):
    ts: float
    pool: str
    change: int  # > 0 added, < 0 removed
    desired: int
    observed: float | None  # the metric the autoscaler saw (mean per ready replica)


@dataclass(frozen=True, slots=True)
class ClusterResult:
    time_unit: str
    timelines: tuple[Timeline, ...]  # one per trace request, in trace order (empty when streaming)
    replicas: tuple[ReplicaReport, ...]
    start_ts: float
    end_ts: float
    streaming: StreamingSummary | None = None
    gateway: dict[str, object] = field(default_factory=dict)
    transfers: dict[str, object] = field(default_factory=dict)
    load_series: tuple[LoadPoint, ...] = ()
    pool_series: tuple[PoolPoint, ...] = ()
    scale_events: tuple[ScaleEvent, ...] = ()
    scheduler_stats: dict[str, object] = field(default_factory=dict)  # every replica's counters, summed

    @property
    def replica_seconds(self) -> float:
        return sum(r.seconds for r in self.replicas)

    @property
    def device_seconds(self) -> float:
        return sum(r.seconds * r.num_devices for r in self.replicas)

    @property
    def cost(self) -> float | None:
        """Σ replica-hours × price per replica-hour (None on a tick clock)."""
        if self.time_unit != "s":
            return None
        return sum(r.seconds / 3600.0 * r.price_per_hour for r in self.replicas)

    @property
    def padding_tokens(self) -> int:
        return sum(r.padding_tokens for r in self.replicas)

    @property
    def unsent_tokens(self) -> int:
        return sum(r.unsent_tokens for r in self.replicas)

    def summary(self, slo: SLO | None = None) -> dict[str, object]:
        waste = {"padding_tokens": self.padding_tokens, "unsent_tokens": self.unsent_tokens}
        if self.streaming is not None:
            summary = self.streaming.summary(time_unit=self.time_unit, slo=slo, **waste)
        else:
            summary = summarize(self.timelines, time_unit=self.time_unit, slo=slo, **waste)
        summary.update(self.fleet_stats(summary))
        return summary

    def fleet_stats(self, summary: dict[str, object] | None = None) -> dict[str, object]:
        cost = self.cost
        good = None
        if summary is not None and isinstance(summary.get("slo_attainment"), float):
            good = float(summary["slo_attainment"]) * float(summary.get("num_requests", 0) or 0)  # type: ignore[arg-type]
        by_pool: dict[str, int] = {}
        for r in self.replicas:
            by_pool[r.pool] = by_pool.get(r.pool, 0) + 1
        return {
            "num_replicas": len(self.replicas),
            "replicas_by_pool": by_pool,
            "replica_seconds": self.replica_seconds,
            "device_seconds": self.device_seconds,
            "cost": cost,
            "cost_per_1k_good": cost / good * 1000 if cost is not None and good else None,
            "kv_usage_mean": _weighted_kv(self.replicas),
            "num_steps": sum(r.num_steps for r in self.replicas),
            "num_preemptions": sum(r.num_preemptions for r in self.replicas),
            "prefix_hit_rate": self.scheduler_stats.get("prefix_hit_rate"),
            **self.gateway,
            **self.transfers,
        }

    def as_sim_result(self, name: str) -> SimResult:
        """The fleet as one `SimResult` (steps, busy time and padding summed over replicas)."""
        busy = sum(r.busy_time for r in self.replicas)
        return SimResult(
            scheduler=name,
            time_unit=self.time_unit,
            timelines=self.timelines,
            num_steps=sum(r.num_steps for r in self.replicas),
            padding_tokens=self.padding_tokens,
            busy_time=busy,
            kv_usage_mean=_weighted_kv(self.replicas),
            kv_usage_max=max((r.kv_usage_max for r in self.replicas), default=0.0),
            unsent_tokens=self.unsent_tokens,
            streaming=self.streaming,
            scheduler_stats=dict(self.scheduler_stats),
        )


def summed_stats(stats: list[dict[str, object]]) -> dict[str, object]:
    """Replicas' `SchedulerStats.as_dict()` summed (counters and rejections; rates recomputed)."""
    total: dict[str, object] = {}
    rejections: dict[str, int] = {}
    for one in stats:
        for key, value in one.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and not key.endswith("_rate"):
                total[key] = total.get(key, 0) + value  # type: ignore[operator]
        for kind, count in dict(one.get("rejections") or {}).items():  # type: ignore[call-overload]
            rejections[kind] = rejections.get(kind, 0) + count
    total["rejections"] = dict(sorted(rejections.items()))
    query, hits = total.get("num_prefix_query_tokens"), total.get("num_prefix_hit_tokens")
    total["prefix_hit_rate"] = hits / query if isinstance(query, int) and query and isinstance(hits, int) else None
    drafts, accepted = total.get("num_draft_tokens"), total.get("num_accepted_draft_tokens")
    total["draft_acceptance_rate"] = (
        accepted / drafts if isinstance(drafts, int) and drafts and isinstance(accepted, int) else None
    )
    return total


def _weighted_kv(replicas: tuple[ReplicaReport, ...]) -> float:
    busy = sum(r.busy_time for r in replicas)
    return sum(r.kv_usage_mean * r.busy_time for r in replicas) / busy if busy else 0.0
