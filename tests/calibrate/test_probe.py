"""The speed probe: points that fit the model, its arithmetic (exact) and the profile's record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from contbatch.calibrate.calibration import at_reference_speed
from contbatch.calibrate.capacity import workload
from contbatch.calibrate.fit import StepSample
from contbatch.calibrate.grid import CalibrationError, decode_contexts
from contbatch.calibrate.loop import LoopStep
from contbatch.calibrate.probe import (
    key_point,
    mean_probe,
    probe_key,
    probe_points,
    reference_probe,
    speed_factor,
    time_probe,
)
from contbatch.calibrate.validate import MetricRow, _median_replay, batch_kind, validate
from contbatch.core.outputs import build_output
from contbatch.engine.llm_engine import EngineConfig
from contbatch.engine.runner import ModelRunner
from contbatch.sim.cost import AffineCost


@pytest.mark.parametrize("max_model_len", [16, 100, 256, 449, 4096])
def test_probe_points_stay_inside_the_model(max_model_len: int) -> None:
    points = probe_points(max_model_len)
    assert len(points) == 4 and len({probe_key(p) for p in points}) == 4
    for prefill, decode, context in points:
        assert decode >= 1 and context >= 1
        assert max([prefill, *decode_contexts(decode, context)]) <= max_model_len - 1
    assert probe_points(4096) == ((0, 4, 256), (0, 12, 256), (0, 24, 256), (256, 8, 256))


def test_keys_round_trip_and_bad_keys_are_refused() -> None:
    assert key_point(probe_key((256, 8, 128))) == (256, 8, 128)
    for bad in ("1,2", "a,b,c", "1,2,-3", ""):
        with pytest.raises(ValueError, match="not a probe point"):
            key_point(bad)


def test_speed_is_the_geometric_mean_of_the_ratios() -> None:
    then = {"0,4,256": 10.0, "0,12,256": 20.0}
    assert speed_factor({"0,4,256": 20.0, "0,12,256": 10.0}, then) == pytest.approx(1.0)
    assert speed_factor({"0,4,256": 11.0, "0,12,256": 22.0, "9,9,9": 1.0}, then) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="different points"):
        speed_factor({"0,4,256": 10.0}, then)
    assert mean_probe({"a": 4.0}, {"a": 9.0}) == {"a": pytest.approx(6.0)}


def test_the_reference_probe_of_a_profile_document() -> None:
    assert reference_probe({"cost": {}}) is None  # a profile from before probes: no speed correction
    found = reference_probe({"speed_probe": {"ms": {"0,4,256": 10, "256,8,256": 40.5}}})
    assert found == {"0,4,256": 10.0, "256,8,256": 40.5}
    for bad in ({"ms": {}}, {"ms": {"0,4,256": 0}}, {"ms": {"0,4,256": "fast"}}, {"ms": [1]}, [1]):
        with pytest.raises(ValueError, match="speed_probe"):
            reference_probe({"speed_probe": bad})


def test_the_probe_times_real_steps_and_refuses_points_beyond_the_model(tiny_model: Path) -> None:
    runner = ModelRunner.from_checkpoint(tiny_model, kv_memory_bytes=4 * 1024**2, block_size=16)
    points = probe_points(runner.spec.max_model_len)
    times = time_probe(runner, points)
    assert sorted(times) == sorted(probe_key(p) for p in points)
    assert all(math.isfinite(ms) and ms > 0 for ms in times.values())
    assert speed_factor(times, times) == 1.0
    with pytest.raises(CalibrationError, match="the model holds 256"):
        time_probe(runner, [(0, 4, 200)])


def test_validate_reprices_only_a_profile(tiny_model: Path) -> None:
    trace = workload("check", 4, 10.0, prompt_tokens=(8, 16), output_tokens=(2, 4), seed=3)
    config = EngineConfig(model=str(tiny_model), kv_cache_memory=4 * 1024**2)
    with pytest.raises(ValueError, match="profile"):
        validate(config, AffineCost(), trace, reference_probe={"0,4,8": 1.0})


def test_steps_are_grouped_by_power_of_two_batch_sizes() -> None:
    kinds = [batch_kind(StepSample(p, d, 10, d, 1.0)) for p, d in ((0, 1), (0, 2), (0, 3), (0, 12), (5, 1), (0, 64))]
    assert [label for _, label in kinds] == [
        "1 decode", "2-3 decodes", "2-3 decodes", "8-15 decodes", "with prefill", "64-127 decodes"
    ]  # fmt: skip
    assert sorted(kinds)[-1][1] == "with prefill" and sorted(kinds)[0][1] == "1 decode"


def test_engine_runs_are_brought_to_the_mean_speed_of_their_probes() -> None:
    out = build_output(0, ())
    runs = [[LoopStep(out, 10.0, 12.0), LoopStep(out, 20.0, None)], [LoopStep(out, 30.0, 33.0)]]
    # probes 8, 10, 12.5 ms: the reference is their geometric mean, 10; the first run ran at
    # sqrt(8 * 10) / 10 = 0.894 (faster), the second at sqrt(10 * 12.5) / 10 = 1.118 (slower)
    probes = [{"0,4,256": 8.0}, {"0,4,256": 10.0}, {"0,4,256": 12.5}]
    steps, speeds = at_reference_speed(runs, probes)
    assert speeds == pytest.approx([math.sqrt(0.8), math.sqrt(1.25)])
    assert [s.execute_ms for s in steps] == pytest.approx([10 / speeds[0], 20 / speeds[0], 30 / speeds[1]])
    assert [s.cycle_ms for s in steps] == pytest.approx([12 / speeds[0], None, 33 / speeds[1]])
    with pytest.raises(ValueError, match="2 runs need 3 probes"):
        at_reference_speed(runs, probes[:2])


def test_a_metric_row_is_the_replay_of_median_error() -> None:
    def rows(*pairs: tuple[float, float]) -> list[MetricRow]:
        return [MetricRow("mean_tpot_ms", "TPOT mean", "ms", predicted, measured) for predicted, measured in pairs]

    # errors +10 %, -5 %, +2 %: the +2 % replay, its prediction beside its own measurement (medians
    # taken apart would give 11 against 10.5: +4.8 %)
    middle = _median_replay(rows((11.0, 10.0), (9.5, 10.0), (10.2, 10.0)))
    assert (middle.predicted, middle.measured) == (10.2, 10.0)
    pair = _median_replay(rows((11.0, 10.0), (9.5, 10.0)))  # an even count: the two middle ones averaged
    assert (pair.predicted, pair.measured) == pytest.approx((10.25, 10.0))
    assert _median_replay(rows((0.0, 0.0), (1.0, 0.0), (2.0, 1.0))).measured == 0.0  # inf error ranks as 0
