"""Cost models: UnitCost's ceil rule, AffineCost's documented targets (through real
SchedulerOutputs built with `build_output`), and `parse_cost`."""

from __future__ import annotations

import math

import pytest

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.sim.cost import AffineCost, CostSpecError, UnitCost, parse_cost


def decode(rid: str, context: int) -> ScheduledChunk:
    """One decode token at the end of a sequence of `context` positions (this one included)."""
    return ScheduledChunk(rid, context - 1, 1, False, True)


def prefill(rid: str, tokens: int, start: int = 0) -> ScheduledChunk:
    return ScheduledChunk(rid, start, tokens, True, True)


def out(chunks: list[ScheduledChunk], padding: int = 0) -> SchedulerOutput:
    return build_output(0, chunks, num_padding_tokens=padding)


# -- UnitCost -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "padding", "capacity", "ticks"),
    [(8, 0, 8, 1), (9, 0, 8, 2), (1, 0, 8, 1), (6, 2, 8, 1), (6, 3, 8, 2), (16, 0, 8, 2), (5, 0, 2, 3), (3, 0, 1, 3)],
)
def test_unit_cost_is_ceil_of_token_work(tokens: int, padding: int, capacity: int, ticks: int) -> None:
    step = out([prefill("a", tokens)], padding)
    assert UnitCost(capacity).step_time(step) == float(ticks)


def test_unit_cost_at_least_one_tick_and_decodes_count() -> None:
    cost = UnitCost(4)
    assert cost.step_time(out([])) == 1.0
    assert cost.step_time(out([decode(f"r{i}", 100) for i in range(5)])) == 2.0  # context is free
    assert cost.step_time(out([decode("a", 10)], padding=4)) == 2.0  # idle slots are work too
    assert cost.time_unit == "tick"


@pytest.mark.parametrize("capacity", [0, -1, 2.5, True, "8"])
def test_unit_cost_capacity_must_be_a_positive_int(capacity: object) -> None:
    with pytest.raises(CostSpecError, match="capacity"):
        UnitCost(capacity)  # type: ignore[arg-type]


# -- AffineCost -----------------------------------------------------------------------------------
def within(actual_s: float, target_ms: float, rel: float = 0.03) -> bool:
    return math.isclose(actual_s * 1000.0, target_ms, rel_tol=rel)


def test_affine_documented_targets() -> None:
    cost = AffineCost()
    one = out([decode("a", 576)])
    assert one.num_decode_tokens == 1 and one.num_context_tokens == 576 and one.num_prefill_tokens == 0
    assert within(cost.step_time(one), 9.5)
    many = out([decode(f"r{i}", 576) for i in range(32)])
    assert many.num_decode_tokens == 32 and many.num_context_tokens == 32 * 576
    assert within(cost.step_time(many), 16.0)
    big = out([prefill("p", 512)])
    assert big.num_prefill_tokens == 512 and big.num_decode_tokens == 0
    assert within(cost.step_time(big), 38.0)
    assert cost.time_unit == "s"


def test_affine_is_linear_and_prices_padding_as_prefill() -> None:
    cost = AffineCost(base_ms=1.0, prefill_ms=0.5, decode_ms=0.25, context_ms=0.0)
    step = out([prefill("a", 4, start=2), decode("b", 10)], padding=2)
    # 1 + 0.5 * (4 prefill + 2 padding) + 0.25 * 1 decode
    assert cost.step_time(step) == pytest.approx(4.25 / 1000.0)
    ctx = AffineCost(base_ms=0.0, prefill_ms=0.0, decode_ms=0.0, context_ms=1.0)
    assert ctx.step_time(step) == pytest.approx((6 + 10) / 1000.0)  # (2 + 4) + (9 + 1) positions


@pytest.mark.parametrize("field", ["base_ms", "prefill_ms", "decode_ms", "context_ms"])
@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan, "1", True])
def test_affine_rejects_bad_parameters(field: str, value: object) -> None:
    with pytest.raises(CostSpecError, match=field):
        AffineCost(**{field: value})  # type: ignore[arg-type]


# -- parse_cost ------------------------------------------------------------------------------------
def test_parse_cost_good_specs() -> None:
    assert parse_cost("unit") == UnitCost(8)
    assert parse_cost("unit:4") == UnitCost(4)
    assert parse_cost("affine") == AffineCost()
    assert parse_cost("affine:base_ms=8,decode_ms=0.07") == AffineCost(base_ms=8.0, decode_ms=0.07)
    assert parse_cost("affine:context_ms=0") == AffineCost(context_ms=0.0)


@pytest.mark.parametrize(
    "spec",
    [
        "unit:0",
        "unit:x",
        "unit:-2",
        "unit:1.5",
        "affine:foo=1",
        "affine:base_ms",
        "affine:base_ms=fast",
        "affine:base_ms=-1",
        "affine:decode_ms=nan",
        "nope",
        "",
        "Unit",
    ],
)
def test_parse_cost_bad_specs(spec: str) -> None:
    with pytest.raises(CostSpecError):
        parse_cost(spec)


def test_parse_cost_messages_say_what_is_wrong() -> None:
    with pytest.raises(CostSpecError, match="nope"):
        parse_cost("nope")
    with pytest.raises(CostSpecError, match="foo"):
        parse_cost("affine:foo=1")
    with pytest.raises(CostSpecError, match="'x'"):
        parse_cost("unit:x")
    assert issubclass(CostSpecError, ValueError)
