"""`calibrate`: measure the engine, fit both cost models, choose one by held-out error, and
return the profile (a `ProfileCost` and its JSON document).

Steps, in order:
1. the grid (`contbatch.calibrate.grid`) timed on a runner of its own, with a KV cache sized for
   its largest point; then as many held-out points drawn off the grid values;
2. the runner's time fitted by `fit_affine` and `fit_table` on the grid points only;
3. `loop_runs` real engine runs (the configured engine: its KV cache and scheduler) of
   calibration workloads offered at `loop_load` of the capacity the table fit predicts (the
   runner alone, so somewhat more: near capacity, where the batches are that matter most), after
   a warm-up run; their steps' cycle times are recorded (`contbatch.calibrate.loop`), and the
   speed probe (`contbatch.calibrate.probe`) is timed before, between and after them: their
   geometric mean is the speed the profile's prices hold at, and each run's step times are
   brought to that speed by the probes around it (`_engine_runs`);
4. for each fit, the engine loop's terms fitted on the even-numbered steps (`_in_loop`): the
   runner's time in the loop over the fit's prediction (`fit_scale`: for steps with prefill
   tokens, for decode-only steps, and for decode-only steps per batch-size bin from
   `min_bin_decodes` decodes up), and the loop's own time
   around the runner, cycle - measured runner time (`fit_loop`: base + per request); each fit with
   its terms is checked against the cycle times of the odd-numbered steps;
5. the fit with the lower score wins: the mean of its mean absolute relative error on the
   held-out grid points (runner time) and on the held-out engine steps (cycle time). Its loop
   terms are then refitted on every step.

The random workloads are seeded and named ``calibration``: a validation trace must use another
seed (`contbatch.calibrate.validate` refuses a trace named like one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from contbatch.calibrate.capacity import saturation_rate, workload
from contbatch.calibrate.fit import (
    ErrorStats,
    StepSample,
    error_stats,
    fit_affine,
    fit_loop,
    fit_scale,
    fit_table,
)
from contbatch.calibrate.grid import (
    CalibrationError,
    GridSpec,
    blocks_needed,
    check_fits_model,
    heldout_points,
    time_points,
)
from contbatch.calibrate.loop import LoopStep, StepRecorder
from contbatch.calibrate.probe import mean_probe, probe_points, speed_factor, time_probe
from contbatch.calibrate.profile_doc import profile_document
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.engine.replay import replay
from contbatch.engine.runner import ModelRunner
from contbatch.sim.cost import AffineCost
from contbatch.sim.costs.profile import ProfileCost
from contbatch.sim.costs.table import TableCost

CALIBRATION_TRACE = "calibration"
Progress = Callable[[str, int], Callable[[], None]]  # (stage description, total) -> tick


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # model, dtype, device, KV cache, scheduler
    grid: GridSpec = field(default_factory=GridSpec)
    threads: int | None = None  # torch intra-op threads; None: torch's current setting (recorded either way)
    num_heldout: int = 24  # off-grid points timed to check the fits
    loop_requests: int = 160  # requests of each calibration engine run (enough for its batch-size bins)
    loop_runs: int = 3  # calibration engine runs (other seeds), the speed probe timed around each
    loop_load: float = 0.85  # its offered rate, as a fraction of the capacity the grid table predicts
    prompt_tokens: tuple[int, int] = (32, 512)  # calibration workload lengths (inclusive)
    output_tokens: tuple[int, int] = (16, 192)
    seed: int = 0
    # decode-only steps of at least this many decodes get in-loop scales per batch-size bin (the grid's
    # decode axis; a bin needs `MIN_BIN_STEPS`); smaller batches keep the scale of all decode-only steps
    min_bin_decodes: int = 1

    def __post_init__(self) -> None:
        if self.loop_runs < 1 or self.loop_requests < 4:
            raise CalibrationError(
                f"the calibration needs 1+ engine runs of 4+ requests, got {self.loop_runs} of {self.loop_requests}"
            )
        if self.grid.clock == "thread-cpu" and self.threads != 1:
            raise CalibrationError(
                f"the thread-cpu clock times one torch thread: set threads to 1 (--threads 1), not {self.threads}"
            )


@dataclass(frozen=True, slots=True)
class Candidate:
    """One fit of the runner with its loop correction and held-out errors."""

    profile: ProfileCost  # with the loop terms of the even-numbered steps
    grid_heldout: ErrorStats  # runner time on the off-grid points
    loop_heldout: ErrorStats  # cycle time on the odd-numbered engine steps

    @property
    def score(self) -> float:
        return (self.grid_heldout.mean_abs + self.loop_heldout.mean_abs) / 2


@dataclass(frozen=True, slots=True)
class Calibration:
    profile: ProfileCost  # the chosen model, its loop correction fitted on every engine step
    document: dict[str, Any]  # the profile file's contents (JSON-ready)


def _no_progress(description: str, total: int) -> Callable[[], None]:
    return lambda: None


def calibrate(config: CalibrationConfig, progress: Progress = _no_progress) -> Calibration:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    engine = LLMEngine(config.engine)
    if config.grid.clock == "thread-cpu" and engine.runner.device.type != "cpu":
        raise CalibrationError(f"the thread-cpu clock does not see work on {engine.runner.device}: use the wall clock")
    check_fits_model(config.grid, engine.max_model_len)
    grid_points, heldout = config.grid.points(), heldout_points(config.grid, config.num_heldout, seed=config.seed + 1)
    runner = _grid_runner(engine, config, [*grid_points, *heldout])
    tick = progress("timing grid steps", (len(grid_points) + len(heldout)) * config.grid.repeats)
    grid = time_points(runner, grid_points, config.grid, on_run=tick)
    off_grid = time_points(runner, heldout, config.grid, on_run=tick)
    del runner
    fits: dict[str, AffineCost | TableCost] = {"affine": fit_affine(grid), "table": fit_table(grid)}
    recorded, probes, speeds = _engine_runs(engine, config, ProfileCost(fits["table"]), progress)
    loop_steps = [s for s in recorded if s.cycle_ms]
    if len(loop_steps) < 4:
        raise ValueError(f"the calibration engine runs gave {len(loop_steps)} timed steps; at least 4 are needed")
    train, heldout_steps = loop_steps[0::2], [s.sample() for s in loop_steps[1::2]]
    bins = [count for count in config.grid.decode if count >= config.min_bin_decodes]
    candidates = {name: _candidate(_in_loop(fit, train, bins), off_grid, heldout_steps) for name, fit in fits.items()}
    chosen = min(candidates, key=lambda name: candidates[name].score)
    profile = _in_loop(fits[chosen], loop_steps, bins)
    document = profile_document(
        config=config, engine=engine, profile=profile, fits=fits, candidates=candidates, chosen=chosen,
        samples={"grid": grid, "heldout": off_grid, "engine_steps": [s.sample() for s in loop_steps]},
        loop_execute_ms=[s.execute_ms for s in loop_steps], speed_probe=(probes, speeds),
    )  # fmt: skip
    return Calibration(profile, document)


def _grid_runner(engine: LLMEngine, config: CalibrationConfig, points: list[tuple[int, int, int]]) -> ModelRunner:
    """A runner of the engine's model whose KV cache holds the largest point."""
    block_size = engine.runner.kv_cache.block_size
    needed = max(blocks_needed(point, block_size) for point in points)
    cfg = config.engine
    return ModelRunner.from_checkpoint(
        engine.model_path, num_blocks=needed, block_size=block_size, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed
    )


def _engine_runs(
    engine: LLMEngine, config: CalibrationConfig, guess: ProfileCost, progress: Progress
) -> tuple[list[LoopStep], list[dict[str, float]], list[float]]:
    """Steps of `loop_runs` real runs of calibration workloads (seeds `seed`, `seed` + 1, ...) at
    `loop_load` of the predicted capacity, each step's times brought to the reference speed;
    the speed probes timed before, between and after the runs; each run's speed.

    The reference speed is the geometric mean of every probe, and a run's speed is the mean of
    the probes around it against that reference (`speed_factor`): a run timed while the machine
    was 3 % slow counts 3 % less, so the drift of a shared machine from one run to the next
    averages out instead of setting the profile's prices."""

    lengths = fitted_lengths(config.prompt_tokens, config.output_tokens, engine.max_model_len)
    shape = workload(CALIBRATION_TRACE, config.loop_requests, 1.0, **lengths, seed=config.seed)
    rate = config.loop_load * saturation_rate(shape, engine.scheduler.config, guess)
    tick = progress(f"engine runs: {config.loop_runs} x {config.loop_requests} requests at {rate:.3g}/s",
                    config.loop_runs + 1)  # fmt: skip
    warm = workload("warm-up", 4, rate * 4, **lengths, seed=config.seed + 7)
    replay(LLMEngine(config.engine, share=engine), warm)
    tick()
    points = probe_points(engine.max_model_len)
    probes = [time_probe(engine.runner, points)]
    runs: list[list[LoopStep]] = []
    for run in range(config.loop_runs):
        trace = workload(CALIBRATION_TRACE, config.loop_requests, rate, **lengths, seed=config.seed + run)
        measured = LLMEngine(config.engine, share=engine)
        with StepRecorder(measured) as recorder:
            replay(measured, trace, seed=config.seed)
        probes.append(time_probe(engine.runner, points))
        runs.append(recorder.steps())
        tick()
    steps, speeds = at_reference_speed(runs, probes)
    return steps, probes, speeds


def at_reference_speed(
    runs: Sequence[Sequence[LoopStep]], probes: Sequence[Mapping[str, float]]
) -> tuple[list[LoopStep], list[float]]:
    """The steps of every run, in order, with their times divided by their run's speed, and those
    speeds: run i's speed is the mean of `probes[i]` and `probes[i + 1]` (timed right before and
    after it) against the mean of every probe, the reference (`speed_factor`)."""
    if len(probes) != len(runs) + 1:
        raise ValueError(f"{len(runs)} runs need {len(runs) + 1} probes (before, between, after), got {len(probes)}")
    reference = mean_probe(*probes)
    speeds = [speed_factor(mean_probe(probes[i], probes[i + 1]), reference) for i in range(len(runs))]
    return [step.scaled(1.0 / speed) for speed, run in zip(speeds, runs, strict=True) for step in run], speeds


def fitted_lengths(
    prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], max_model_len: int
) -> dict[str, tuple[int, int]]:
    """The workload's length ranges, scaled down together when the longest request would not fit the model."""
    factor = min(1.0, max_model_len / (prompt_tokens[1] + output_tokens[1]))

    def scaled(lengths: tuple[int, int]) -> tuple[int, int]:
        return max(1, int(lengths[0] * factor)), max(1, int(lengths[1] * factor))

    return {"prompt_tokens": scaled(prompt_tokens), "output_tokens": scaled(output_tokens)}


MIN_SCALE_STEPS = 4  # steps of a kind needed to give it its own in-loop scale
MIN_BIN_STEPS = 16  # decode-only steps a batch-size bin needs to get its own in-loop scale


def _in_loop(fit: AffineCost | TableCost, steps: list[LoopStep], bins: list[int]) -> ProfileCost:
    """`fit` with the engine loop's terms, fitted on `steps`: the runner's scale (measured runner
    time over predicted) for decode-only steps and for steps with prefill tokens apart (each kind
    needs `MIN_SCALE_STEPS`, else one scale over all), the decode-only scale also per batch-size
    bin (`bins`: the lowest decode count of each, increasing; a bin needs `MIN_BIN_STEPS`), and
    the loop's own time around the runner (cycle - measured runner time)."""
    grid_only = ProfileCost(fit)

    def scale_of(kind: list[LoopStep]) -> float:
        return fit_scale([grid_only.compute_ms(s.out) for s in kind], [s.execute_ms for s in kind])

    prefills = [s for s in steps if s.out.num_prefill_tokens]
    decodes = [s for s in steps if not s.out.num_prefill_tokens]
    separate = len(prefills) >= MIN_SCALE_STEPS and len(decodes) >= MIN_SCALE_STEPS
    scale = scale_of(decodes) if separate else scale_of(steps)
    by_batch = {low: [s for s in decodes if low <= s.out.num_decode_tokens < high]
                for low, high in zip(bins, [*bins[1:], math.inf], strict=False)}  # fmt: skip
    decode_scales = tuple((low, scale_of(kind)) for low, kind in by_batch.items() if len(kind) >= MIN_BIN_STEPS)
    loop = fit_loop([s.out.num_requests for s in steps], [(s.cycle_ms or 0.0) - s.execute_ms for s in steps])
    return ProfileCost(
        fit,
        loop_scale=scale,
        prefill_loop_scale=scale_of(prefills) if separate else None,
        decode_loop_scales=decode_scales,
        loop_base_ms=loop.base_ms,
        loop_request_ms=loop.request_ms,
    )


def _candidate(profile: ProfileCost, off_grid: list[StepSample], heldout_steps: list[StepSample]) -> Candidate:
    grid_errors = error_stats(lambda s: profile.compute_ms(s.to_output()), off_grid)
    loop_errors = error_stats(lambda s: profile.step_time(s.to_output()) * 1000.0, heldout_steps)
    return Candidate(profile, grid_errors, loop_errors)
