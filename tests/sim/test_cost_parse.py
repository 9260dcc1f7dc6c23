"""`parse_cost` over every cost model: good specs build the expected model, bad ones raise a
CostSpecError that names what is wrong and lists what is known."""

from __future__ import annotations

import pytest

from contbatch.sim.cost import COST_MODELS, AffineCost, CostSpecError, UnitCost, parse_cost
from contbatch.sim.costs import DEVICES, MODELS, ROOFLINE_PARAMS, RooflineCost


def roofline(spec: str) -> RooflineCost:
    cost = parse_cost(spec)
    assert isinstance(cost, RooflineCost)
    return cost


def test_existing_models_still_parse() -> None:
    assert parse_cost("unit") == UnitCost(8)
    assert parse_cost("affine:base_ms=8") == AffineCost(base_ms=8.0)
    assert {"unit", "affine", "roofline", "table", "profile"} <= set(COST_MODELS)


def test_roofline_targets() -> None:
    cost = roofline("roofline:llama-2-7b@a100")
    assert (cost.model, cost.device, cost.num_devices) == (MODELS["llama-2-7b"], DEVICES["a100"], 1)
    assert roofline("roofline:llama-3-70b@h100x4").num_devices == 4
    assert roofline("roofline:Llama-3-8B@H100-SXM").device == DEVICES["h100"]  # case and aliases
    assert roofline("roofline:mixtral-8x7b@a100-80gbx2").num_devices == 2
    assert roofline("roofline: qwen2-7b@l4 ").model == MODELS["qwen2-7b"]


def test_roofline_overrides() -> None:
    cost = roofline("roofline:llama-2-7b@a100,eff=0.5")
    assert (cost.device.compute_efficiency, cost.device.memory_efficiency) == (0.5, 0.5)
    cost = roofline("roofline:llama-2-7b@a100,eff=0.5,mem_eff=0.9,link_eff=0.6")
    assert (cost.device.compute_efficiency, cost.device.memory_efficiency, cost.device.link_efficiency) == (
        0.5,
        0.9,
        0.6,
    )
    cost = roofline("roofline:llama-2-7b@a100,overhead_ms=0,block_size=32,bytes=1,kv_bytes=1")
    assert (cost.overhead_ms, cost.block_size, cost.model.bytes_per_value, cost.model.kv_bytes_per_value) == (
        0.0,
        32,
        1.0,
        1.0,
    )
    moe = roofline("roofline:mixtral-8x7b@h100x2,ep=2,router=dirichlet,skew=0.3,seed=4")
    assert (moe.expert_parallel, moe.router.kind, moe.router.skew, moe.router.seed) == (2, "dirichlet", 0.3, 4)
    base, slower = parse_cost("roofline:llama-2-7b@a100"), parse_cost("roofline:llama-2-7b@a100,eff=0.3")
    assert base != slower


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("nope", ["'nope'", "unit", "affine", "roofline", "table", "llama-2-7b", "a100"]),
        ("roofline:gpt-5@a100", ["'gpt-5'", *MODELS]),
        ("roofline:llama-2-7b@tpu", ["'tpu'", *DEVICES]),
        ("roofline:llama-2-7b", ["MODEL@DEVICE", "llama-2-7b", "a100"]),
        ("roofline:", ["MODEL@DEVICE"]),
        ("roofline:llama-2-7b@a100,foo=1", ["'foo=1'", *ROOFLINE_PARAMS]),
        ("roofline:llama-2-7b@a100,eff", ["'eff'"]),
        ("roofline:llama-2-7b@a100,eff=1.5", ["eff", "(0, 1]"]),
        ("roofline:llama-2-7b@a100,eff=0", ["eff"]),
        ("roofline:llama-2-7b@a100,eff=x", ["eff", "'x'"]),
        ("roofline:llama-2-7b@a100,eff=0.5,eff=0.6", ["eff", "twice"]),
        ("roofline:llama-2-7b@a100,overhead_ms=-1", ["overhead_ms"]),
        ("roofline:llama-2-7b@a100,block_size=0", ["block_size"]),
        ("roofline:llama-2-7b@a100x0", ["device count"]),
        ("roofline:llama-3-70b@a100", ["do not fit", "a100x2"]),
        ("roofline:llama-2-7b@a100,ep=2", ["ep", "mixture-of-experts"]),
        ("table", ["table:PATH"]),
        ("table:/no/such/file.csv", ["/no/such/file.csv", "no such file"]),
    ],
)
def test_bad_specs_name_the_problem(spec: str, names: list[str]) -> None:
    with pytest.raises(CostSpecError) as info:
        parse_cost(spec)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_cost_spec_error_is_shared() -> None:
    from contbatch.sim.costs import CostSpecError as FromCosts

    assert FromCosts is CostSpecError and issubclass(CostSpecError, ValueError)
