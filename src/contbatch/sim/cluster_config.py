"""What a simulated fleet is made of: pools of replicas, the gateway's admission stage, the
routers, prefill/decode disaggregation and its KV link, autoscaling. Frozen and validated here,
so that `contbatch.sim.cluster.simulate_cluster` cannot fail on its input.

- A `PoolSpec` is a set of identical replicas: one scheduler config, one cost model (devices,
  tensor parallelism), a price per replica-hour, a role: `mixed` (prefill and decode, the
  aggregated case), `prefill` or `decode`. Pools of one role form one routing group behind one
  router, so a heterogeneous fleet is several pools of one role.
- A fleet is either aggregated (only `mixed` pools; `router` routes) or disaggregated (`prefill`
  and `decode` pools, both needed; `prefill_router` routes prefills, `router` decodes, each its
  own router instance) with a `DisaggConfig`.
- `AdmissionConfig`: the gateway's queue bound, a global token bucket (requests per time unit,
  burst), per-tenant buckets and a per-replica in-flight limit; a request leaves the gateway
  queue when its tenant's bucket and the global one both hold a token and some replica has fewer
  than `max_in_flight` of the gateway's requests (it is routed among those), and is rejected when
  the queue is full.
- `signal_delay`: routers see scrapes of the replicas' metrics as of `now - signal_delay`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contbatch.core import SCHEDULERS, SchedulerConfig
from contbatch.routing import make_router
from contbatch.sim.autoscale import AutoscaleConfig
from contbatch.sim.cost import CostModel

ROLES = ("mixed", "prefill", "decode")


class FleetError(ValueError):
    """A fleet specification is inconsistent; the message names what."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    cost: CostModel
    config: SchedulerConfig
    num_replicas: int = 1  # at the start (the autoscaler may change it)
    role: str = "mixed"
    scheduler: str = "continuous"
    cost_spec: str = ""  # how the cost model was written, for reports
    price_per_hour: float = 0.0  # per replica (all its devices), in money per hour of the clock
    num_devices: int = 1  # devices per replica, for reports (equal device counts across fleets)
    autoscale: AutoscaleConfig | None = None

    def check(self) -> None:
        if not self.name or any(c in self.name for c in " ,:/"):
            raise FleetError(f"pool name {self.name!r}: use letters, digits, - and _")
        if self.role not in ROLES:
            raise FleetError(f"pool {self.name}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.scheduler not in SCHEDULERS:
            raise FleetError(f"pool {self.name}: unknown scheduler {self.scheduler!r}")
        lowest = self.autoscale.min_replicas if self.autoscale is not None else 1
        if self.num_replicas < 0 or (self.num_replicas < 1 and lowest > 0):
            raise FleetError(f"pool {self.name}: num_replicas must be >= 1, got {self.num_replicas}")
        if self.price_per_hour < 0 or self.num_devices < 1:
            raise FleetError(f"pool {self.name}: price_per_hour must be >= 0 and num_devices >= 1")
        if self.autoscale is not None:
            self.autoscale.check(f"pool {self.name}")
            if not self.autoscale.min_replicas <= self.num_replicas <= self.autoscale.max_replicas:
                raise FleetError(f"pool {self.name}: num_replicas must be within the autoscaler's min and max")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_queue: int | None = None  # requests waiting at the gateway for a token; None: unbounded
    rate: float | None = None  # global token bucket: requests per time unit; None: no limit
    burst: float = 1.0  # tokens a bucket holds (it starts full)
    tenant_rates: tuple[tuple[str, float], ...] = ()  # (tenant, requests per time unit), same burst
    max_in_flight: int | None = None  # per replica: beyond, requests wait at the gateway (flow control)

    @property
    def is_open(self) -> bool:
        """Admits everyone at once (the stage is skipped)."""
        return self.rate is None and not self.tenant_rates and self.max_in_flight is None

    def check(self) -> None:
        if self.max_queue is not None and self.max_queue < 0:
            raise FleetError(f"admission: max_queue must be >= 0, got {self.max_queue}")
        rates = [r for _, r in self.tenant_rates] + ([self.rate] if self.rate is not None else [])
        if any(not r > 0 for r in rates) or not self.burst >= 1:
            raise FleetError("admission: every rate must be > 0 and burst >= 1")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise FleetError(f"admission: max_in_flight must be >= 1, got {self.max_in_flight}")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """The KV transfer link: each replica has one port of `bandwidth` bytes per second each way;
    a transfer takes `latency` plus its bytes over the bandwidth, after the transfers queued
    before it on either port (contention); bytes are `kv_bytes_per_token` per prompt token (None:
    the prefill pool's model spec says, for a roofline cost model)."""

    bandwidth: float = 50e9  # bytes/s per port (400 Gb/s)
    latency: float = 0.0005  # seconds per transfer (clock units)
    kv_bytes_per_token: float | None = None

    def check(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise FleetError("link: bandwidth must be > 0 and latency >= 0")
        if self.kv_bytes_per_token is not None and not self.kv_bytes_per_token > 0:
            raise FleetError("link: kv_bytes_per_token must be > 0")


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Prefill/decode disaggregation: a request whose uncached prompt tokens (its prompt less the
    prefix this gateway believes its decode replica caches) reach `threshold` is prefilled on the
    prefill pool and its KV moved over `link`; shorter ones are served whole on the decode side."""

    threshold: int = 0
    link: LinkConfig = field(default_factory=LinkConfig)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    pools: tuple[PoolSpec, ...]
    router: str = "least_outstanding"  # the mixed (aggregated) or decode group's router spec
    prefill_router: str = "least_outstanding"  # the prefill group's, when disaggregated
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    disagg: DisaggConfig | None = None
    signal_delay: float = 0.0  # routers see replica scrapes as of now - signal_delay

    @property
    def is_disaggregated(self) -> bool:
        return any(p.role == "prefill" for p in self.pools)

    @property
    def time_unit(self) -> str:
        return self.pools[0].cost.time_unit

    def pools_of(self, role: str) -> tuple[PoolSpec, ...]:
        return tuple(p for p in self.pools if p.role == role)

    def check(self) -> FleetSpec:
        """`self` if consistent; FleetError naming the problem otherwise."""
        if not self.pools:
            raise FleetError("a fleet needs at least one pool")
        for pool in self.pools:
            pool.check()
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise FleetError(f"pool names repeat: {', '.join(names)}")
        if len({p.cost.time_unit for p in self.pools}) > 1:
            raise FleetError("every pool's cost model must run on one clock (all seconds or all ticks)")
        self._check_roles()
        self.admission.check()
        if not self.signal_delay >= 0:
            raise FleetError(f"signal_delay must be >= 0, got {self.signal_delay}")
        for spec in (self.router, self.prefill_router):
            try:
                make_router(spec)
            except ValueError as exc:
                raise FleetError(str(exc)) from None
        return self

    def _check_roles(self) -> None:
        roles = {p.role for p in self.pools}
        if "mixed" in roles and roles != {"mixed"}:
            raise FleetError("a fleet is aggregated (mixed pools only) or disaggregated (prefill and decode pools)")
        if roles - {"mixed"} and roles != {"prefill", "decode"}:
            raise FleetError("a disaggregated fleet needs both a prefill and a decode pool")
        if self.is_disaggregated != (self.disagg is not None):
            raise FleetError("disagg (the KV link and threshold) is given exactly when there is a prefill pool")
        if self.disagg is not None:
            self.disagg.link.check()
            if self.disagg.threshold < 0:
                raise FleetError("disagg: threshold must be >= 0")


def aggregated(
    cost: CostModel, config: SchedulerConfig, num_replicas: int, *, router: str = "least_outstanding", **pool: object
) -> FleetSpec:
    """The common case: one pool of `num_replicas` identical mixed replicas behind `router`."""
    spec = PoolSpec("replica", cost, config, num_replicas, **pool)  # type: ignore[arg-type]
    return FleetSpec((spec,), router=router).check()
