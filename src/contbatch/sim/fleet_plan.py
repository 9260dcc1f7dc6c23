"""Planning fleets: the cheapest fleet that meets an SLO at a given request rate, over
homogeneous, heterogeneous and disaggregated fleets (`contbatch capacity --rate R --kind ...
--disagg`).

A `ReplicaKind` is something one can buy: a cost model (a model on a device, tensor-parallel
degree included) and a price per replica-hour. The search, every fleet run on the cluster
simulator with the trace at the rate:

- homogeneous: for each kind, the fewest replicas meeting the target (doubling, then bisection);
- heterogeneous: for each pair of kinds, each count of the first below its homogeneous answer
  and the fewest of the second that completes it (bisection);
- disaggregated: for each kind, the smallest total of prefill plus decode replicas for which
  some P:D split meets the target (totals by doubling then bisection; at each total the best
  split by a ternary search on attainment).

The cheapest is the passing fleet of the lowest price per hour (then the fewest devices). The
search assumes attainment does not fall as replicas are added; every fleet simulated is kept as a
candidate, so the table shows what was tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contbatch.core import SchedulerConfig
from contbatch.metrics import SLO
from contbatch.sim.cluster import simulate_cluster
from contbatch.sim.cluster_build import devices_of
from contbatch.sim.cluster_config import DisaggConfig, FleetSpec, LinkConfig, PoolSpec
from contbatch.sim.cost import CostModel
from contbatch.traces import Trace

Pools = tuple[tuple["ReplicaKind", str, int], ...]  # (kind, role, count)


@dataclass(frozen=True, slots=True)
class ReplicaKind:
    name: str
    cost_spec: str
    cost: CostModel = field(compare=False)
    price_per_hour: float = 1.0
    num_devices: int = 1

    @staticmethod
    def of(cost_spec: str, cost: CostModel, price_per_hour: float = 1.0) -> ReplicaKind:
        """A kind named after its device (`roofline:M@a100x2` → `a100x2`), else its spec."""
        name = cost_spec.rpartition("@")[2].split(",")[0] if "@" in cost_spec else cost_spec
        return ReplicaKind(name, cost_spec, cost, price_per_hour, devices_of(cost))


@dataclass(frozen=True, slots=True)
class FleetCandidate:
    label: str  # e.g. "3 x a100", "2 x a100 + 1 x h100", "P:D 1:2 x a100"
    shape: str  # homogeneous, heterogeneous or disaggregated
    num_replicas: int
    num_devices: int
    price_per_hour: float
    summary: dict[str, object]
    passes: bool

    @property
    def attainment(self) -> float:
        value = self.summary.get("slo_attainment")
        return float(value) if isinstance(value, int | float) else 0.0


@dataclass(frozen=True, slots=True)
class FleetPlan:
    rate: float
    target: float
    cheapest: FleetCandidate | None
    candidates: tuple[FleetCandidate, ...]  # every fleet simulated, cheapest first


@dataclass
class FleetPlanner:
    trace: Trace  # already at the rate planned for
    config: SchedulerConfig
    slo: SLO
    target: float = 0.9
    scheduler: str = "continuous"
    router: str = "least_outstanding"
    prefill_router: str = "least_outstanding"
    link: LinkConfig = field(default_factory=LinkConfig)
    threshold: int = 0
    max_replicas: int = 64
    tried: dict[Pools, FleetCandidate] = field(default_factory=dict)

    def fleet(self, pools: Pools) -> FleetSpec:
        specs = tuple(
            PoolSpec(
                f"{kind.name}-{role}" if role != "mixed" else kind.name,
                kind.cost,
                self.config,
                count,
                role=role,
                scheduler=self.scheduler,
                cost_spec=kind.cost_spec,
                price_per_hour=kind.price_per_hour,
                num_devices=kind.num_devices,
            )
            for kind, role, count in pools
            if count
        )
        disagg = DisaggConfig(self.threshold, self.link) if any(r == "prefill" for _, r, _ in pools) else None
        return FleetSpec(specs, router=self.router, prefill_router=self.prefill_router, disagg=disagg).check()

    def evaluate(self, pools: Pools, shape: str) -> FleetCandidate:
        known = self.tried.get(pools)
        if known is not None:
            return known
        summary = simulate_cluster(self.trace, self.fleet(pools), keep_timelines=False).summary(self.slo)
        attained = summary.get("slo_attainment")
        candidate = FleetCandidate(
            label=_label(pools),
            shape=shape,
            num_replicas=sum(c for _, _, c in pools),
            num_devices=sum(k.num_devices * c for k, _, c in pools),
            price_per_hour=sum(k.price_per_hour * c for k, _, c in pools),
            summary=summary,
            passes=isinstance(attained, float) and attained >= self.target,
        )
        self.tried[pools] = candidate
        return candidate

    def homogeneous(self, kind: ReplicaKind) -> FleetCandidate | None:
        found = _fewest(lambda n: self.evaluate(((kind, "mixed", n),), "homogeneous").passes, 1, self.max_replicas)
        return None if found is None else self.tried[((kind, "mixed", found),)]

    def heterogeneous(self, a: ReplicaKind, b: ReplicaKind, most_a: int, most_b: int) -> list[FleetCandidate]:
        """For each count of `a` in [1, most_a), the fewest of `b` in [1, most_b] completing it."""
        found = []
        for count_a in range(1, most_a):

            def passes(n: int, count_a: int = count_a) -> bool:
                return self.evaluate(((a, "mixed", count_a), (b, "mixed", n)), "heterogeneous").passes

            count_b = _fewest(passes, 1, most_b)
            if count_b is not None:
                found.append(self.tried[((a, "mixed", count_a), (b, "mixed", count_b))])
        return found

    def disaggregated(self, kind: ReplicaKind, most: int) -> FleetCandidate | None:
        """The smallest total of prefill + decode replicas (at most `most`) with a passing split,
        and its best split: totals by doubling then bisection, splits by a ternary search on
        attainment (taken as unimodal in the prefill share)."""
        found = _fewest(lambda total: self.best_split(kind, total).passes, 2, max(2, most))
        return None if found is None else self.best_split(kind, found)

    def best_split(self, kind: ReplicaKind, total: int) -> FleetCandidate:
        """The split of `total` replicas into prefill and decode with the highest attainment."""

        def at(p: int) -> FleetCandidate:
            return self.evaluate(((kind, "prefill", p), (kind, "decode", total - p)), "disaggregated")

        lo, hi = 1, total - 1
        while hi - lo > 2:
            third = (hi - lo) // 3
            left, right = lo + third, hi - third
            if at(left).attainment < at(right).attainment:
                lo = left + 1
            else:
                hi = right
        return max((at(p) for p in range(lo, hi + 1)), key=lambda c: c.attainment)  # (ties: fewest prefill)


def _fewest(passes: object, low: int, high: int) -> int | None:
    """The smallest n in [low, high] with passes(n), assuming passes is monotone (None if none)."""
    assert callable(passes)
    n = low
    while not passes(n):
        if n >= high:
            return None
        n = min(n * 2, high)
    lo = max(low - 1, n // 2)  # fails (or below the range)
    hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) else (mid, hi)
    return hi


def _label(pools: Pools) -> str:
    roles = {role for _, role, _ in pools}
    if "prefill" in roles:
        counts = {role: (kind.name, count) for kind, role, count in pools}
        name = counts["prefill"][0]
        return f"P:D {counts['prefill'][1]}:{counts['decode'][1]} x {name}"
    return " + ".join(f"{count} x {kind.name}" for kind, _, count in pools if count)


def cheapest_fleet(
    planner: FleetPlanner,
    kinds: list[ReplicaKind],
    *,
    rate: float,
    heterogeneous: bool = True,
    disaggregated: bool = False,
) -> FleetPlan:
    """The search of the module docstring over `kinds`."""
    homogeneous = {kind: planner.homogeneous(kind) for kind in kinds}
    if heterogeneous:
        for i, a in enumerate(kinds):
            for b in kinds[i + 1 :]:
                found_a, found_b = homogeneous[a], homogeneous[b]
                most_a = found_a.num_replicas if found_a else planner.max_replicas
                most_b = found_b.num_replicas if found_b else planner.max_replicas
                planner.heterogeneous(a, b, most_a, most_b)
    if disaggregated:
        for kind in kinds:
            found = homogeneous[kind]
            planner.disaggregated(kind, 2 * found.num_replicas if found else planner.max_replicas)
    candidates = sorted(planner.tried.values(), key=lambda c: (c.price_per_hour, c.num_devices, -c.attainment, c.label))
    cheapest = next((c for c in candidates if c.passes), None)
    return FleetPlan(rate, planner.target, cheapest, tuple(candidates))
