"""Fleets from plain descriptions (`contbatch.sim.cluster_build.build_fleet`): each shape, and
every problem named by its key."""

from __future__ import annotations

from typing import Any

import pytest

from contbatch.core import PRESETS
from contbatch.sim import parse_cost
from contbatch.sim.cluster_build import build_fleet
from contbatch.sim.cluster_config import FleetError

COST = parse_cost("roofline:llama-2-7b@a100x2")


def build(desc: dict[str, Any]) -> Any:
    return build_fleet(desc, cost=COST, config=PRESETS["engine"], cost_spec="roofline:llama-2-7b@a100x2")


def test_shapes() -> None:
    one = build({})
    assert [(p.role, p.num_replicas, p.num_devices, p.price_per_hour) for p in one.pools] == [("mixed", 1, 2, 1.0)]
    pd = build({"prefill": 1, "decode": 3, "router": "round_robin", "threshold": 512, "link": {"bandwidth": 1e9}})
    assert [(p.role, p.num_replicas) for p in pd.pools] == [("prefill", 1), ("decode", 3)]
    assert pd.disagg is not None and pd.disagg.threshold == 512 and pd.disagg.link.bandwidth == 1e9
    h100 = {"name": "h", "cost": "roofline:llama-2-7b@h100", "price": 4}
    het = build({"pools": [{"name": "a", "replicas": 2}, h100]})
    assert [(p.name, p.num_devices, p.price_per_hour) for p in het.pools] == [("a", 2, 1.0), ("h", 1, 4.0)]
    scaled = build({"replicas": 2, "autoscale": {"metric": "kv_usage", "target": 0.7, "max_replicas": 4}})
    assert scaled.pools[0].autoscale is not None and scaled.pools[0].autoscale.target == 0.7
    gated = build({"admission": {"rate": 5, "tenant_rates": {"heavy": 1}}})
    assert gated.admission.tenant_rates == (("heavy", 1.0),)


@pytest.mark.parametrize(
    ("desc", "message"),
    [
        ({"replica": 2}, "fleet.replica: unknown key"),
        ({"replicas": 0}, "fleet.replicas: expected an integer >= 1"),
        ({"prefill": 2}, "fleet.decode: expected an integer"),
        ({"replicas": 2, "prefill": 1, "decode": 1}, "not both"),
        ({"router": "fastest"}, "unknown router 'fastest'"),
        ({"autoscale": {"metric": "gpu"}}, "fleet.autoscale: .*metric must be one of"),
        ({"autoscale": {"speed": 1}}, "fleet.autoscale.speed: unknown key"),
        ({"admission": {"rate": -1}}, "fleet.admission: .*rate must be > 0"),
        ({"pools": [{"cost": "nope"}]}, r"fleet.pools\[0\].cost: "),
        ({"pools": []}, "non-empty list"),
        ({"replicas": 2, "autoscale": {"min_replicas": 3, "max_replicas": 4}}, "within the autoscaler"),
    ],
)
def test_errors_name_the_key(desc: dict[str, Any], message: str) -> None:
    with pytest.raises(FleetError, match=message):
        build(desc)
