"""Calibration on a tiny model with a small grid: the fitted profile predicts measured step times it
was not fitted on.

This runs in the test gate, on a shared 2-core machine that may be fully loaded: a step's wall
time measured there can be several times its quiet value (the runner's thread waits for a core),
and the machine's speed can change between the grid's passes and the held-out points' passes,
which `calibrate` times one after the other. So the grid here is timed by the runner thread's CPU
time (`clock="thread-cpu"`, one torch thread), which such waits do not inflate, and nothing here
bounds a timing error. What is checked: the profile file holds the profile exactly, the chosen
fit is the one of least held-out score, and the fit explains how held-out step times vary with
the step's shape better than a constant does, after the one common scale that best matches
predictions to measurements (a machine uniformly slower during the held-out passes does not move
that comparison). On a quiet machine the fit's error is about a fifth of the constant's. How close
wall-clock predictions are is a timing claim: `benchmarks/calibrate_tiny.py` measures it.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from contbatch.calibrate import CalibrationConfig, GridSpec, StepSample, calibrate
from contbatch.calibrate.grid import CalibrationError
from contbatch.calibrate.profile_doc import write_profile
from contbatch.engine.llm_engine import EngineConfig
from contbatch.sim.cost import parse_cost
from contbatch.sim.costs.profile import ProfileCost

GRID = GridSpec(
    prefill=(0, 32, 96, 160), decode=(0, 1, 4, 16, 48), context=(8, 32, 96), warmup=1, repeats=3, clock="thread-cpu"
)


def _config(model: Path, grid: GridSpec = GRID) -> CalibrationConfig:
    engine = EngineConfig(model=str(model), kv_cache_memory=8 * 1024**2)
    return CalibrationConfig(engine=engine, grid=grid, threads=1, num_heldout=16, loop_requests=16, loop_runs=2,
                             prompt_tokens=(8, 96), output_tokens=(4, 48))  # fmt: skip


def _rows(document: dict[str, object], name: str) -> list[StepSample]:
    samples = document["samples"]
    assert isinstance(samples, dict)
    return [StepSample(p, d, c, r, ms) for p, d, c, r, ms in samples[name]]


def test_the_fitted_profile_predicts_held_out_steps(tiny_model: Path, tmp_path: Path) -> None:
    result = calibrate(_config(tiny_model))
    path = tmp_path / "profile.json"
    write_profile(result.document, path)
    cost = parse_cost(f"profile:{path}")
    assert isinstance(cost, ProfileCost) and cost.model == result.profile.model
    grid, heldout, steps = (_rows(result.document, name) for name in ("grid", "heldout", "engine_steps"))
    assert len(grid) == len(GRID.points()) and len(heldout) == 16 and len(steps) >= 8
    for sample in [*grid, *steps]:  # the file holds the profile exactly
        assert cost.step_time(sample.to_output()) == result.profile.step_time(sample.to_output())

    measured = [s.ms for s in heldout]
    fitted = _scale_free_error([cost.compute_ms(s.to_output()) for s in heldout], measured)
    constant = _scale_free_error([1.0] * len(heldout), measured)
    assert fitted < constant, (fitted, constant, [(s, cost.compute_ms(s.to_output())) for s in heldout])
    fits = result.document["fits"]
    chosen = fits[result.document["chosen"]]
    assert chosen["score"] == min(f["score"] for f in fits.values())
    for fit in fits.values():  # the score is the mean of the two held-out errors, whatever their size
        errors = (fit["heldout_grid"]["mean_abs_rel_error"], fit["heldout_engine_steps"]["mean_abs_rel_error"])
        assert fit["score"] == pytest.approx(sum(errors) / 2) and all(math.isfinite(e) and e >= 0 for e in errors)
    assert chosen["heldout_grid"]["num_samples"] == 16


def _scale_free_error(predicted: list[float], measured: list[float]) -> float:
    """Mean |k * predicted / measured - 1| with k the median of measured / predicted: the error in
    how the times vary, whatever the machine's speed while they were measured."""
    k = statistics.median(m / p for p, m in zip(predicted, measured, strict=True))
    return statistics.mean(abs(k * p / m - 1) for p, m in zip(predicted, measured, strict=True))


def test_the_profile_records_where_it_was_measured(tiny_model: Path) -> None:
    grid = GridSpec(prefill=(0, 32, 64), decode=(0, 1, 4), context=(8, 32), warmup=0, repeats=3)
    document = calibrate(_config(tiny_model, grid)).document
    assert document["engine"]["threads"] == 1 and document["engine"]["dtype"] == "float32"
    assert document["engine"]["torch_version"] and document["machine"]["cpu_count"] >= 1
    assert document["model"]["path"] == str(tiny_model) and document["model"]["num_layers"] == 2
    assert document["model"]["num_parameters"] > 0
    assert document["grid"]["prefill"] == [0, 32, 64] and document["chosen"] in ("affine", "table")
    assert document["grid"]["engine_runs"] == 2 and len(document["speed_probe"]["run_speeds"]) == 2
    assert document["grid"]["clock"] == "wall"


def test_the_thread_clock_needs_one_cpu_thread_and_a_known_clock() -> None:
    with pytest.raises(CalibrationError, match="set threads to 1 \\(--threads 1\\), not 2"):
        CalibrationConfig(grid=GRID, threads=2)
    with pytest.raises(CalibrationError, match="unknown clock 'cpu': use one of wall, thread-cpu"):
        GridSpec(clock="cpu")


@pytest.mark.parametrize(("runs", "requests"), [(0, 16), (2, 3)])
def test_a_calibration_without_engine_runs_is_refused(runs: int, requests: int) -> None:
    with pytest.raises(CalibrationError, match="1\\+ engine runs of 4\\+ requests"):
        CalibrationConfig(loop_runs=runs, loop_requests=requests)


def test_a_grid_beyond_the_model_is_refused(tiny_model: Path) -> None:
    grid = GridSpec(prefill=(0, 32, 200), decode=(0, 1), context=(8, 100))
    with pytest.raises(CalibrationError, match="the model holds 256"):
        calibrate(_config(tiny_model, grid))
