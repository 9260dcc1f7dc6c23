"""Sweeps over fleets: a sweep file's ``fleet:`` section and its ``fleet.KEY`` grid axes.

With a ``fleet:`` mapping (the keys of `contbatch.sim.cluster_build`: replicas, prefill and
decode, router, prefill_router, threshold, link, signal_delay, price, devices, autoscale,
admission, pools) every grid point runs the cluster simulator on that fleet instead of one
replica. A grid axis ``fleet.KEY`` varies one of its scalar keys (``fleet.router``,
``fleet.replicas``, ``fleet.shape`` (``"4"``, or ``"1:3"`` prefill:decode), ``fleet.prefill``,
``fleet.decode``, ``fleet.threshold``,
``fleet.signal_delay``, ``fleet.price``...), so a file can sweep routers, pool sizes and P:D
ratios. A point's result adds the fleet's keys (replica-seconds, cost, transfers...) to the
summary. ``sample_interval: S`` in the section records every replica's load and KV usage every
S (clock units) and each pool's replica count at every change; ``contbatch sweep --plot`` then
draws them per point (`fleet-load-N`, `fleet-replicas-N`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from contbatch.core import SchedulerConfig
from contbatch.sim.cluster_build import FLEET_KEYS, build_fleet
from contbatch.sim.cluster_config import FleetError, FleetSpec
from contbatch.sim.cost import CostModel, parse_cost
from contbatch.sweep._reader import Reader

PREFIX = "fleet."
AXIS_KEYS = tuple(k for k in FLEET_KEYS if k not in ("link", "autoscale", "admission", "pools"))


def is_fleet_axis(name: str) -> bool:
    return name.startswith(PREFIX)


def fleet_axis_name(key: str) -> str:
    """`fleet.router` as given (ValueError for a key that is not a scalar fleet key)."""
    field = key[len(PREFIX) :].strip().replace("-", "_")
    if field not in AXIS_KEYS:
        raise ValueError(f"unknown fleet axis {key!r}; known: {', '.join(PREFIX + k for k in AXIS_KEYS)}")
    return PREFIX + field


def point_fleet(base: Mapping[str, Any] | None, values: tuple[tuple[str, Any], ...]) -> dict[str, Any] | None:
    """The fleet description of a grid point: the file's ``fleet:`` with the point's fleet axes
    applied (an axis of the fleet's size, ``fleet.shape``, ``fleet.replicas``, ``fleet.prefill`` or
    ``fleet.decode``, replaces the file's other size keys); None when the sweep has no fleet."""
    axes = {name[len(PREFIX) :]: value for name, value in values if is_fleet_axis(name)}
    if base is None and not axes:
        return None
    desc = dict(base or {})
    sizes = ("shape", "replicas", "prefill", "decode")
    varied = {k for k in axes if k in sizes}
    if varied:  # an axis of the fleet's size replaces the file's size (a prefill axis keeps its decode)
        for key in sizes:
            if key not in varied and not ({key, *varied} <= {"prefill", "decode"}):
                desc.pop(key, None)
    desc.update(axes)
    return desc


SIM_KEYS = ("sample_interval",)  # how the fleet is observed, not what it is


def make_fleet(
    desc: Mapping[str, Any], cost_spec: str, cost: CostModel, config: SchedulerConfig, scheduler: str
) -> FleetSpec:
    """The point's fleet (FleetError naming the key when it is not one)."""
    fleet = {k: v for k, v in desc.items() if k not in SIM_KEYS}
    interval = desc.get("sample_interval")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0):
        raise FleetError(f"fleet.sample_interval: expected a number > 0, got {interval!r}")
    return build_fleet(fleet, cost=cost, config=config, cost_spec=cost_spec, scheduler=scheduler)


def checked_point_fleet(
    reader: Reader,
    doc: dict[str, Any],
    values: tuple[tuple[str, Any], ...],
    run: tuple[str, SchedulerConfig, str],
    where: str,
) -> dict[str, Any] | None:
    """The point's fleet description, checked by building it (None: no fleet)."""
    base = reader.mapping("fleet", doc["fleet"]) if "fleet" in doc else None
    desc = point_fleet(base, values)
    if desc is not None:
        cost, config, scheduler = run
        try:
            make_fleet(desc, cost, parse_cost(cost), config, scheduler)
        except ValueError as exc:
            raise reader.fail("fleet" if not any(is_fleet_axis(n) for n, _ in values) else where, str(exc)) from None
    return desc


__all__ = ["FleetError", "checked_point_fleet", "fleet_axis_name", "is_fleet_axis", "make_fleet", "point_fleet"]
