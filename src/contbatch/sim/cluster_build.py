"""A fleet from a plain description (a sweep file's ``fleet:`` section, a planner's candidate):
the one place that turns keys into a `FleetSpec`.

Keys (all optional; the default is one replica behind ``least_outstanding``)::

    replicas: 4                  # an aggregated fleet: one pool of mixed replicas
    prefill: 2                   # a disaggregated one: a prefill pool and a decode pool
    decode: 2
    shape: "2:2"                 # the same in one value (a sweep axis): "N" replicas, or "P:D"
    router: least_outstanding    # the mixed or decode pool's router spec (contbatch.routing)
    prefill_router: round_robin  # the prefill pool's
    threshold: 0                 # selective disaggregation: uncached prompt tokens to go to prefill
    link: {bandwidth: 5.0e10, latency: 0.0005, kv_bytes_per_token: 524288}
    signal_delay: 0.0            # routers see scrapes this old
    price: 2.0                   # per replica-hour (default 1.0: cost counts replica-hours)
    devices: 1                   # per replica (default: the roofline spec's xN, else 1)
    autoscale: {metric: in_flight, target: 16, interval: 15, ...}   # the mixed (or decode) pool
    admission: {max_queue: 1000, rate: 50, burst: 10, tenant_rates: {heavy: 5}}
    pools:                       # instead of replicas/prefill/decode: explicit (heterogeneous) pools
      - {name: a100, replicas: 2, cost: "roofline:llama-2-7b@a100", price: 2.0}
      - {name: h100, replicas: 1, cost: "roofline:llama-2-7b@h100", price: 4.5, role: mixed}

Every problem is a `FleetError` naming the key (``fleet.autoscale.metric: ...``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from contbatch.core import SchedulerConfig
from contbatch.sim.autoscale import AutoscaleConfig
from contbatch.sim.cluster_config import (
    AdmissionConfig,
    DisaggConfig,
    FleetError,
    FleetSpec,
    LinkConfig,
    PoolSpec,
)
from contbatch.sim.cost import CostModel, CostSpecError, parse_cost

FLEET_KEYS = (
    "shape",
    "replicas",
    "prefill",
    "decode",
    "router",
    "prefill_router",
    "threshold",
    "link",
    "signal_delay",
    "price",
    "devices",
    "autoscale",
    "admission",
    "pools",
)
POOL_KEYS = ("name", "role", "replicas", "cost", "price", "devices", "autoscale")


def devices_of(cost: CostModel) -> int:
    """Devices one replica of `cost` uses: a roofline spec's tensor-parallel degree, else 1."""
    value = getattr(cost, "num_devices", 1)
    return value if isinstance(value, int) and value >= 1 else 1


def _mapping(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise FleetError(f"{where}: expected a mapping, got {value!r}")
    return value


def _known(where: str, given: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise FleetError(f"{where}.{unknown[0]}: unknown key; known: {', '.join(known)}")


def _number(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FleetError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _count(where: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FleetError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _build(where: str, cls: type[Any], given: Mapping[str, Any]) -> Any:
    """`cls(**given)`, checked (its `check`), every problem a FleetError naming `where`."""
    _known(where, given, tuple(f.name for f in dataclasses.fields(cls)))
    try:
        built = cls(**given)
        if isinstance(built, AutoscaleConfig):
            built.check(where)
        else:
            built.check()
    except (TypeError, ValueError) as exc:
        raise FleetError(f"{where}: {exc}") from None
    return built


def autoscale_config(where: str, value: object) -> AutoscaleConfig:
    return _build(where, AutoscaleConfig, _mapping(where, value))  # type: ignore[no-any-return]


def _admission(where: str, value: object) -> AdmissionConfig:
    given = dict(_mapping(where, value))
    if "tenant_rates" in given:
        rates = _mapping(f"{where}.tenant_rates", given["tenant_rates"])
        given["tenant_rates"] = tuple((str(k), _number(f"{where}.tenant_rates.{k}", v)) for k, v in rates.items())
    return _build(where, AdmissionConfig, given)  # type: ignore[no-any-return]


def _link(where: str, value: object) -> LinkConfig:
    return _build(where, LinkConfig, _mapping(where, value))  # type: ignore[no-any-return]


def _cost(where: str, spec: object) -> CostModel:
    if not isinstance(spec, str):
        raise FleetError(f"{where}: expected a cost model spec, got {spec!r}")
    try:
        return parse_cost(spec)
    except CostSpecError as exc:
        raise FleetError(f"{where}: {exc}") from None


def _pool(where: str, value: object, base: PoolSpec) -> PoolSpec:
    given = _mapping(where, value)
    _known(where, given, POOL_KEYS)
    cost_spec = str(given["cost"]) if "cost" in given else base.cost_spec
    cost = _cost(f"{where}.cost", given["cost"]) if "cost" in given else base.cost
    scale = autoscale_config(f"{where}.autoscale", given["autoscale"]) if "autoscale" in given else None
    name = given.get("name", base.name)
    if not isinstance(name, str):
        raise FleetError(f"{where}.name: expected a string, got {name!r}")
    return dataclasses.replace(
        base,
        name=name,
        role=str(given.get("role", "mixed")),
        num_replicas=_count(f"{where}.replicas", given.get("replicas", 1)),
        cost=cost,
        cost_spec=cost_spec,
        price_per_hour=_number(f"{where}.price", given.get("price", base.price_per_hour)),
        num_devices=_count(f"{where}.devices", given.get("devices", devices_of(cost))),
        autoscale=scale,
    )


def _pools(desc: Mapping[str, Any], base: PoolSpec) -> tuple[PoolSpec, ...]:
    if "pools" in desc:
        if any(k in desc for k in ("replicas", "prefill", "decode")):
            raise FleetError("fleet.pools: give pools, or replicas / prefill and decode, not both")
        items = desc["pools"]
        if not isinstance(items, list) or not items:
            raise FleetError(f"fleet.pools: expected a non-empty list of pools, got {items!r}")
        return tuple(_pool(f"fleet.pools[{i}]", item, dataclasses.replace(base, name=f"pool{i}"))
                     for i, item in enumerate(items))  # fmt: skip
    scale = autoscale_config("fleet.autoscale", desc["autoscale"]) if "autoscale" in desc else None
    if "prefill" in desc or "decode" in desc:
        if "replicas" in desc:
            raise FleetError("fleet.replicas: give replicas, or prefill and decode, not both")
        prefill = dataclasses.replace(base, name="prefill", role="prefill",
                                      num_replicas=_count("fleet.prefill", desc.get("prefill")))  # fmt: skip
        decode = dataclasses.replace(base, name="decode", role="decode", autoscale=scale,
                                     num_replicas=_count("fleet.decode", desc.get("decode")))  # fmt: skip
        return prefill, decode
    count = _count("fleet.replicas", desc.get("replicas", 1))
    return (dataclasses.replace(base, num_replicas=count, autoscale=scale),)


def _shape(desc: Mapping[str, Any]) -> dict[str, Any]:
    """`shape: "N"` as `replicas: N`, `shape: "P:D"` as `prefill: P, decode: D`."""
    if "shape" not in desc:
        return dict(desc)
    if any(k in desc for k in ("replicas", "prefill", "decode", "pools")):
        raise FleetError("fleet.shape: give shape, or replicas / prefill and decode / pools, not both")
    shape = str(desc["shape"]).strip()
    parts = shape.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise FleetError(f"fleet.shape: expected N (replicas) or P:D (prefill:decode replicas), got {shape!r}")
    rest = {k: v for k, v in desc.items() if k != "shape"}
    if len(parts) == 1:
        return {**rest, "replicas": int(parts[0])}
    return {**rest, "prefill": int(parts[0]), "decode": int(parts[1])}


def build_fleet(
    desc: Mapping[str, Any],
    *,
    cost: CostModel,
    config: SchedulerConfig,
    cost_spec: str = "",
    scheduler: str = "continuous",
) -> FleetSpec:
    """The fleet `desc` describes (see the module docstring); pools use `cost`, `config` and
    `scheduler` unless they say otherwise."""
    _known("fleet", _mapping("fleet", desc), FLEET_KEYS)
    desc = _shape(desc)
    base = PoolSpec("replica", cost, config, 1, scheduler=scheduler, cost_spec=cost_spec,
                    price_per_hour=_number("fleet.price", desc.get("price", 1.0)),
                    num_devices=_count("fleet.devices", desc.get("devices", devices_of(cost))))  # fmt: skip
    pools = _pools(desc, base)
    disagg = None
    if any(p.role == "prefill" for p in pools):
        link = _link("fleet.link", desc["link"]) if "link" in desc else LinkConfig()
        disagg = DisaggConfig(_count("fleet.threshold", desc.get("threshold", 0), 0), link)
    fleet = FleetSpec(
        pools,
        router=str(desc.get("router", "least_outstanding")),
        prefill_router=str(desc.get("prefill_router", "least_outstanding")),
        admission=_admission("fleet.admission", desc["admission"]) if "admission" in desc else AdmissionConfig(),
        disagg=disagg,
        signal_delay=_number("fleet.signal_delay", desc.get("signal_delay", 0.0)),
    )
    try:
        return fleet.check()
    except FleetError as exc:
        raise FleetError(f"fleet: {exc}") from None
