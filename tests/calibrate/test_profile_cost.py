"""`profile:PATH`: the profile cost model, its file format and its errors (exact, no timing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contbatch.core.outputs import SchedulerOutput
from contbatch.sim.cost import AffineCost, CostSpecError, parse_cost
from contbatch.sim.costs.profile import MIN_STEP_MS, ProfileCost, load_profile, table_ms
from contbatch.sim.costs.table import TableCost


def _out(prefill: int, decode: int, context: int, requests: int, padding: int = 0) -> SchedulerOutput:
    return SchedulerOutput(0, (), prefill + decode, prefill, decode, context, padding, num_requests=requests)


AFFINE = {"base_ms": 4.0, "prefill_ms": 0.25, "decode_ms": 0.5, "context_ms": 0.01}
TABLE = {  # 2 contexts x 2 prefills x 3 decodes: value = 100 * c_index + 10 * p_index + d_index + 1
    "prefill_axis": [0, 100],
    "decode_axis": [0, 1, 9],
    "context_axis": [10, 30],
    "step_ms": [1, 2, 3, 11, 12, 13, 101, 102, 103, 111, 112, 113],
}


def _document(**cost: Any) -> dict[str, Any]:
    base = {"model": "affine", "loop_scale": 1.0, "loop_base_ms": 0.5, "loop_request_ms": 0.1, "swap_ms_per_block": 0.3,
            "affine": AFFINE, "table": TABLE}  # fmt: skip
    return {"format": "contbatch-profile", "version": 1, "machine": {"hostname": "x"}, "cost": {**base, **cost}}


def _write(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return path


def test_affine_profile_prices_runner_plus_loop(tmp_path: Path) -> None:
    cost = parse_cost(f"profile:{_write(tmp_path, _document())}")
    assert isinstance(cost, ProfileCost) and cost.model == "affine" and cost.time_unit == "s"
    out = _out(prefill=64, decode=8, context=600, requests=9, padding=4)
    runner_ms = 4.0 + 0.25 * (64 + 4) + 0.5 * 8 + 0.01 * 600
    assert cost.step_time(out) == pytest.approx((runner_ms + 0.5 + 0.1 * 9) / 1000, rel=1e-12)
    assert cost.step_time(out) == pytest.approx(AffineCost(**AFFINE).step_time(out) + (0.5 + 0.9) / 1000, rel=1e-12)


def test_loop_scale_multiplies_the_runner_time_only(tmp_path: Path) -> None:
    cost = load_profile(_write(tmp_path, _document(loop_scale=1.5)))
    out = _out(prefill=0, decode=2, context=100, requests=2)
    assert cost.step_time(out) * 1000 == pytest.approx(1.5 * (4.0 + 0.5 * 2 + 0.01 * 100) + 0.5 + 0.1 * 2)


def test_steps_with_prefill_use_their_own_loop_scale(tmp_path: Path) -> None:
    cost = load_profile(_write(tmp_path, _document(loop_scale=1.5, prefill_loop_scale=0.5)))
    decode = _out(prefill=0, decode=2, context=100, requests=2)
    mixed = _out(prefill=64, decode=2, context=164, requests=3)
    assert cost.step_time(decode) * 1000 == pytest.approx(1.5 * (4.0 + 0.5 * 2 + 0.01 * 100) + 0.5 + 0.1 * 2)
    assert cost.step_time(mixed) * 1000 == pytest.approx(0.5 * (4.0 + 0.25 * 64 + 0.5 * 2 + 0.01 * 164) + 0.5 + 0.3)
    # absent (an older profile) or null: one scale for every step
    assert load_profile(_write(tmp_path, _document(loop_scale=1.5, prefill_loop_scale=None))).prefill_loop_scale is None
    with pytest.raises(CostSpecError, match=r"cost\.prefill_loop_scale"):
        load_profile(_write(tmp_path, _document(prefill_loop_scale=0)))


def test_table_profile_interpolates_along_all_three_axes(tmp_path: Path) -> None:
    cost = load_profile(_write(tmp_path, _document(model="table", loop_base_ms=0.0, loop_request_ms=0.0)))
    assert cost.model == "table" and isinstance(cost.compute, TableCost)
    # grid points: decode 1, context per decode 10 / 30
    assert cost.step_time(_out(0, 1, 10, 1)) * 1000 == pytest.approx(2.0)
    assert cost.step_time(_out(100, 1, 130, 2)) * 1000 == pytest.approx(112.0)
    # halfway in context (20), prefill (50) and decode (5): the mean of the eight corners
    corners = [2, 3, 12, 13, 102, 103, 112, 113]
    assert cost.step_time(_out(50, 5, 50 + 5 * 20, 6)) * 1000 == pytest.approx(sum(corners) / 8)
    # beyond the axes: clamped to the edge
    assert table_ms(cost.compute, 1000, 50, 500) == pytest.approx(113.0)


def test_model_parameter_overrides_the_chosen_fit(tmp_path: Path) -> None:
    path = _write(tmp_path, _document())
    assert parse_cost(f"profile:{path},model=table").model == "table"  # type: ignore[attr-defined]
    with pytest.raises(CostSpecError, match="model"):
        parse_cost(f"profile:{path},model=cubic")
    with pytest.raises(CostSpecError, match="bad parameter"):
        parse_cost(f"profile:{path},scale=2")


def test_decode_steps_take_the_scale_of_their_batch_size_bin(tmp_path: Path) -> None:
    bins = [[8, 2.0], [16, 3.0]]
    cost = load_profile(_write(tmp_path, _document(loop_scale=1.5, prefill_loop_scale=0.5, decode_loop_scales=bins)))
    assert cost.decode_loop_scales == ((8, 2.0), (16, 3.0))
    for decodes, scale in ((1, 1.5), (7, 1.5), (8, 2.0), (15, 2.0), (16, 3.0), (500, 3.0)):
        assert cost.loop_scale_of(_out(0, decodes, 10 * decodes, decodes)) == scale
    assert cost.loop_scale_of(_out(5, 9, 100, 10)) == 0.5  # a step with prefill tokens: the prefill scale
    runner_ms = cost.compute_ms(_out(0, 9, 90, 9))
    assert cost.step_time(_out(0, 9, 90, 9)) == pytest.approx((2.0 * runner_ms + 0.5 + 0.1 * 9) / 1000)
    for bad in ([[8, 2.0], [8, 3.0]], [[0, 1.0]], [[8, 0]], [[8]], "8:2", [[8.5, 1.0]], [[True, 1.0]]):
        with pytest.raises(CostSpecError, match="decode_loop_scales"):
            load_profile(_write(tmp_path, _document(decode_loop_scales=bad)))
    with pytest.raises(CostSpecError, match="decode_loop_scales"):
        ProfileCost(AffineCost(), decode_loop_scales=((8, 1.0), (4, 1.0)))


def test_speed_scales_the_whole_step_and_is_a_spec_parameter(tmp_path: Path) -> None:
    path = _write(tmp_path, _document())
    step = _out(10, 3, 40, 4)
    base = load_profile(path).step_time(step)
    assert load_profile(path).at_speed(1.25).step_time(step) == pytest.approx(1.25 * base)
    assert parse_cost(f"profile:{path},speed=0.5").step_time(step) == pytest.approx(0.5 * base)
    for bad in ("0", "-1", "fast", "inf"):
        with pytest.raises(CostSpecError, match="speed"):
            parse_cost(f"profile:{path},speed={bad}")
        with pytest.raises(CostSpecError, match="prefill_speed"):
            parse_cost(f"profile:{path},prefill_speed={bad}")


def test_prefill_speed_scales_steps_with_prefill_tokens_alone(tmp_path: Path) -> None:
    path = _write(tmp_path, _document())
    prefill, decode = _out(10, 3, 40, 4), _out(0, 3, 40, 3)
    base = load_profile(path)
    both = base.at_speed(0.8, 1.5)
    assert both.step_time(prefill) == pytest.approx(1.5 * base.step_time(prefill))
    assert both.step_time(decode) == pytest.approx(0.8 * base.step_time(decode))
    spec = parse_cost(f"profile:{path},prefill_speed=2")
    assert spec.step_time(prefill) == pytest.approx(2 * base.step_time(prefill))
    assert spec.step_time(decode) == pytest.approx(base.step_time(decode))
    assert both.at_speed(1.2).step_time(prefill) == pytest.approx(1.2 * base.step_time(prefill))  # one speed again
    with pytest.raises(CostSpecError, match="prefill_speed"):
        ProfileCost(AffineCost(), prefill_speed=0.0)
    with pytest.raises(CostSpecError, match="speed"):
        ProfileCost(AffineCost(), speed=0.0)


def test_negative_loop_correction_never_makes_a_step_free(tmp_path: Path) -> None:
    cost = load_profile(_write(tmp_path, _document(loop_base_ms=-100.0)))
    assert cost.step_time(_out(0, 1, 10, 1)) == MIN_STEP_MS / 1000


def test_swaps_are_priced_per_block(tmp_path: Path) -> None:
    cost = load_profile(_write(tmp_path, _document(model="table", loop_base_ms=0.0, loop_request_ms=0.0)))
    swapped = SchedulerOutput(0, (), 1, 0, 1, 10, swapped_in=(("r", (1, 2, 3)),), num_requests=1)
    assert cost.step_time(swapped) * 1000 == pytest.approx(2.0 + 3 * 0.3)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not a JSON profile"),
        ("[1, 2]", "the document must be a JSON object"),
        (json.dumps({**_document(), "format": "csv"}), "field 'format'"),
        (json.dumps({**_document(), "version": 7}), "field 'version': must be 1"),
        (json.dumps({**_document(), "cost": 3}), "field 'cost' must be a JSON object"),
        (json.dumps(_document(model="cubic")), "field 'cost.model'"),
        (json.dumps(_document(loop_base_ms="fast")), "field 'cost.loop_base_ms'"),
        (json.dumps(_document(loop_request_ms=None)), "field 'cost.loop_request_ms'"),
        (json.dumps(_document(loop_scale=0)), "field 'cost.loop_scale': must be > 0"),
        (json.dumps(_document(affine={**AFFINE, "decode_ms": -1})), "field 'cost.affine.decode_ms': must be a finite"),
        (json.dumps(_document(affine={"base_ms": 1})), "field 'cost.affine.prefill_ms'"),
        (json.dumps(_document(model="table", table={**TABLE, "decode_axis": [0, 1.5, 9]})), "cost.table.decode_axis"),
        (json.dumps(_document(model="table", table={**TABLE, "step_ms": [1, 2]})), "step_ms has 2 values"),
        (json.dumps(_document(model="table", table={**TABLE, "context_axis": [30, 10]})), "strictly increasing"),
    ],
)
def test_bad_profiles_name_the_file_and_field(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(CostSpecError) as caught:
        parse_cost(f"profile:{path}")
    message = str(caught.value)
    assert message.startswith(str(path)) and needle in message and "\n" not in message


def test_missing_profile_file_is_a_cost_spec_error(tmp_path: Path) -> None:
    with pytest.raises(CostSpecError, match="no such profile file"):
        parse_cost(f"profile:{tmp_path / 'absent.json'}")
    with pytest.raises(CostSpecError, match="expected profile:PATH"):
        parse_cost("profile:")


def test_step_speed_is_measured_over_priced_time_of_the_replays_own_steps(tmp_path: Path) -> None:
    """`validate`'s `steps` speed source: total cycle time over the profile's price at calibration
    speed, whatever speed the profile is at; exact."""
    from contbatch.calibrate.fit import StepSample
    from contbatch.calibrate.validate import step_speed

    cost = load_profile(_write(tmp_path, _document()))
    steps = [StepSample(0, 4, 400, 4, 0.0), StepSample(64, 2, 300, 3, 0.0)]
    priced = [1000.0 * cost.step_time(step.to_output()) for step in steps]
    measured = [StepSample(s.num_prefill_tokens, s.num_decode_tokens, s.num_context_tokens, s.num_requests, 1.1 * p)
                for s, p in zip(steps, priced, strict=True)]  # fmt: skip
    assert step_speed(cost, measured) == pytest.approx(1.1)
    assert step_speed(cost.at_speed(2.0), measured) == pytest.approx(1.1)  # against calibration, not the current speed
    assert step_speed(cost, []) == 1.0


def test_kind_speeds_read_decode_only_and_prefill_steps_apart(tmp_path: Path) -> None:
    """`validate`'s `step-kinds` source: `step_speed` per kind; a kind without steps takes the
    speed of all the steps."""
    from contbatch.calibrate.fit import StepSample
    from contbatch.calibrate.validate import kind_speeds, step_speed

    cost = load_profile(_write(tmp_path, _document()))
    shapes = [StepSample(0, 4, 400, 4, 0.0), StepSample(64, 2, 300, 3, 0.0), StepSample(0, 8, 900, 8, 0.0)]
    factors = [0.9, 1.3, 0.9]
    measured = [StepSample(s.num_prefill_tokens, s.num_decode_tokens, s.num_context_tokens, s.num_requests,
                           f * 1000.0 * cost.step_time(s.to_output()))
                for s, f in zip(shapes, factors, strict=True)]  # fmt: skip
    assert kind_speeds(cost, measured) == pytest.approx((0.9, 1.3))
    only_decodes = [measured[0], measured[2]]
    assert kind_speeds(cost, only_decodes) == pytest.approx((0.9, step_speed(cost, only_decodes)))
