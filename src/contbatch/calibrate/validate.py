"""`validate`: the real engine and the calibrated simulator on one trace, metric by metric.

1. The engine runs the trace in real time (`contbatch run`'s replay), after a short warm-up run
   on an engine that shares the model (first steps pay one-off allocation costs), `replays`
   times on fresh engines: each measured metric is the median over the replays (a real-time
   measurement on a shared machine drifts by several percent from one minute to the next, and
   queueing near capacity amplifies it), and every replay's values are kept;
2. the simulator runs the same trace with the profile's cost model and *the scheduler config the
   engine ran with* (its KV block count and block size, max_model_len, every budget), the same
   scheduler kind, once per replay, each replay priced at a machine speed (`SPEED_SOURCES`): the
   speed of a shared machine moves by a few percent between minutes, which the profile cannot
   know, and near capacity that alone moves TPOT by ten percent. A speed is a pair: (decode-only
   steps, steps with prefill tokens). `step-kinds`: the replay's own engine steps of each kind,
   their total cycle time against the profile's price of the same steps (read from step times,
   never from the latencies predicted; prefill is compute-bound and a decode step memory-bound, so
   a neighbour or a machine state moves the two apart: issue 18 saw prefill steps 19 % slower
   against the profile than decode steps in one replay, and a single speed turned that into -23 %
   on mean TTFT); `steps`: one speed for both, from all the replay's steps; `probe`: the
   profile's speed probe (fixed synthetic steps, `contbatch.calibrate.probe`) timed right before
   and after the replay; `calibration`: the speed of the calibration run;
3. both sets of timelines are summarised by `contbatch.metrics.summarize`, and each metric of
   `METRICS` is compared replay by replay, relative error = predicted / measured - 1: a metric's
   row is the replay with the median error (the mean of the two middle replays for an even
   count), its prediction and its measurement side by side. Pairing keeps what a replay's
   machine speed did to both sides together; medians taken apart would set one replay's
   measurement against another's prediction;
4. each engine step's cycle time (`contbatch.calibrate.loop`) is compared with the cost model's
   price of that very step, at the replay's speed: the step-level error, which tells a wrong
   cost model from queueing that amplifies a small one (with speeds from `steps`, the error on
   the replays' total step time is 0 by construction, with `step-kinds` that of each kind; the
   per-step errors remain).

A trace named ``calibration`` is refused: the calibration run used it, so it proves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contbatch.calibrate.calibration import CALIBRATION_TRACE
from contbatch.calibrate.capacity import workload
from contbatch.calibrate.fit import ErrorStats, StepSample, predicted_error_stats
from contbatch.calibrate.loop import StepRecorder
from contbatch.calibrate.probe import Point, mean_probe, points_of, speed_factor, time_probe
from contbatch.core import SchedulerConfig, Timeline, make_scheduler
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.engine.replay import replay
from contbatch.metrics import summarize
from contbatch.sim.cost import CostModel
from contbatch.sim.costs.profile import ProfileCost, Speed, Totals, kind_totals, speeds_by_kind, whole_speed
from contbatch.sim.loop import simulate
from contbatch.traces import Trace

# where each replay's machine speed comes from (see the module docstring, step 2)
SPEED_SOURCES = ("step-kinds", "steps", "probe", "calibration")
LATENCY_NAMES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
STAT_NAMES = (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))
# (summary key, label, unit) in the order they are reported
METRICS: tuple[tuple[str, str, str], ...] = (
    *((f"{stat}_{key}_ms", f"{label} {name}", "ms") for key, name in LATENCY_NAMES for stat, label in STAT_NAMES),
    ("output_throughput", "throughput", "tok/s"),
    ("request_throughput", "request throughput", "req/s"),
    ("makespan", "makespan", "s"),
)


@dataclass(frozen=True, slots=True)
class MetricRow:
    key: str  # the summary key (vllm-bench naming)
    label: str
    unit: str
    predicted: float
    measured: float

    @property
    def rel_error(self) -> float:
        """predicted / measured - 1 (0 when both are 0)."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return self.predicted / self.measured - 1.0


@dataclass(frozen=True, slots=True)
class Validation:
    trace: Trace
    rows: tuple[MetricRow, ...]
    measured: tuple[Timeline, ...]  # the engine's timelines, trace start at 0
    predicted: tuple[Timeline, ...]  # the simulator's
    measured_summary: dict[str, object]
    predicted_summary: dict[str, object]
    step_error: ErrorStats  # the cost model's price of each engine step against its cycle time
    steps: tuple[StepSample, ...] = ()  # the engine's steps with their cycle times (not in as_dict)
    replays: tuple[dict[str, float], ...] = ()  # each replay's measured value of every `METRICS` key
    predicted_replays: tuple[dict[str, float], ...] = ()  # and its predicted value
    speeds: tuple[Speed, ...] = ()  # each replay's machine speed against calibration, as predicted; () at 1
    speed_source: str = "calibration"  # where `speeds` come from (`SPEED_SOURCES`)
    speeds_by_source: dict[str, tuple[Speed, ...]] | None = None  # every source's speeds that could be read
    step_error_by_batch: dict[str, ErrorStats] | None = None  # `step_error` per kind of step (`batch_kind`)

    def row(self, key: str) -> MetricRow:
        return next(r for r in self.rows if r.key == key)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace.name,
            "num_requests": len(self.trace),
            "source": self.trace.source,
            "metrics": {r.key: {"label": r.label, "unit": r.unit, "predicted": r.predicted, "measured": r.measured,
                                "rel_error": r.rel_error} for r in self.rows},
            "step_time_error": self.step_error.as_dict(),
            "step_time_error_by_batch": {k: e.as_dict() for k, e in (self.step_error_by_batch or {}).items()},
            "measured_replays": list(self.replays),
            "predicted_replays": list(self.predicted_replays),
            "machine_speed_per_replay": list(self.speeds),
            "machine_speed_source": self.speed_source,
            "machine_speed_per_replay_by_source": {k: list(v) for k, v in (self.speeds_by_source or {}).items()},
            "measured": self.measured_summary,
            "predicted": self.predicted_summary,
        }  # fmt: skip


def validate(
    config: EngineConfig,
    cost: CostModel,
    trace: Trace,
    *,
    engine: LLMEngine | None = None,
    replays: int = 1,
    reference_probe: Mapping[str, float] | None = None,
    speed_source: str | None = None,
) -> Validation:
    """Run `trace` on the engine `replays` times (fresh engines sharing `engine`'s model when
    given) and in the simulator. Each metric's row is the replay with its median error
    (`_median_replay`); the timelines and summaries shown are those of the median replay by
    measured mean E2E.

    `speed_source` (`SPEED_SOURCES`; default `probe` with a `reference_probe`, else
    `calibration`) sets the machine speed each replay is predicted at (`ProfileCost.at_speed`):
    all but `calibration` need a `ProfileCost`, `probe` the profile's speed probe (`reference_probe`),
    which is then timed right before and after each replay."""
    speed_source = speed_source or ("probe" if reference_probe is not None else "calibration")
    if speed_source not in SPEED_SOURCES:
        raise ValueError(f"unknown speed source {speed_source!r}; known: {', '.join(SPEED_SOURCES)}")
    if trace.name == CALIBRATION_TRACE:
        raise ValueError(f"trace {trace.name!r} is the calibration workload: validate on another trace")
    if cost.time_unit != "s" or trace.time_unit != "s":
        raise ValueError("validation needs a cost model and a trace in seconds")
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    if speed_source != "calibration" and not isinstance(cost, ProfileCost):
        raise ValueError("a machine speed re-prices a calibrated profile only: use --cost profile:PATH")
    if speed_source == "probe" and reference_probe is None:
        raise ValueError("speed source 'probe' needs the profile's speed probe")
    base = engine or LLMEngine(config)
    points = points_of(reference_probe) if reference_probe is not None else None
    runs = [_replay(base, config, trace, points) for _ in range(replays)]
    by_source: dict[str, tuple[Speed, ...]] = {}
    if isinstance(cost, ProfileCost):
        totals = [step_totals(cost, run.steps) for run in runs]  # one pricing pass per replay
        by_source["step-kinds"] = tuple(speeds_by_kind(t) for t in totals)
        by_source["steps"] = tuple((whole_speed(t), whole_speed(t)) for t in totals)
    if reference_probe is not None:
        probed = (speed_factor(run.probe, reference_probe) for run in runs if run.probe)
        by_source["probe"] = tuple((speed, speed) for speed in probed)
    speeds = by_source.get(speed_source, ())
    costs: list[CostModel] = [cost] * replays
    if isinstance(cost, ProfileCost) and speeds:
        costs = [cost.at_speed(*speed) for speed in speeds]
    scheduler = runs[0].scheduler_config
    results = [simulate(trace, make_scheduler(config.scheduler_kind, scheduler), c) for c in costs]
    measured_values = tuple(_values(run.summary) for run in runs)
    predicted_values = tuple(_values(result.summary()) for result in results)
    middle = sorted(range(replays), key=lambda i: measured_values[i]["mean_e2el_ms"])[(replays - 1) // 2]
    steps = [step for run in runs for step in run.steps]
    prices = [1000.0 * c.step_time(step.to_output()) for run, c in zip(runs, costs, strict=True) for step in run.steps]
    pairs = list(zip(predicted_values, measured_values, strict=True))
    rows = tuple(_median_replay([MetricRow(k, name, unit, p[k], m[k]) for p, m in pairs]) for k, name, unit in METRICS)
    shown = results[middle]
    return Validation(
        trace, rows, runs[middle].timelines, shown.timelines, runs[middle].summary, shown.summary(),
        predicted_error_stats(prices, steps), tuple(steps), measured_values, predicted_values, speeds,
        speed_source, by_source, _by_batch(prices, steps),
    )  # fmt: skip


def step_totals(cost: ProfileCost, steps: list[StepSample]) -> Totals:
    """One pass over a replay's engine steps: their measured cycle time and the profile's price of
    the same steps at calibration speed, for the decode-only steps and for those with prefill."""
    return kind_totals(((step.ms, step.to_output()) for step in steps), cost.at_speed(1.0))


def step_speed(cost: ProfileCost, steps: list[StepSample]) -> float:
    """`whole_speed` of `steps` (the `steps` speed source)."""
    return whole_speed(step_totals(cost, steps))


def kind_speeds(cost: ProfileCost, steps: list[StepSample]) -> Speed:
    """`speeds_by_kind` of `steps` (the `step-kinds` speed source)."""
    return speeds_by_kind(step_totals(cost, steps))


@dataclass(frozen=True, slots=True)
class _Replay:
    timelines: tuple[Timeline, ...]
    scheduler_config: SchedulerConfig  # the config the engine ran with
    summary: dict[str, object]
    steps: list[StepSample]  # with their cycle times
    probe: dict[str, float] | None  # the speed probe around the replay (geometric mean of before and after)


def _replay(base: LLMEngine, config: EngineConfig, trace: Trace, points: list[Point] | None) -> _Replay:
    """One warmed-up real-time replay on a fresh engine, with the speed probe of `points` around it."""

    head = trace.requests[:4]
    warm = workload(
        "warm-up", len(head), 100.0, prompt_tokens=_span(head, "prompt"), output_tokens=_span(head, "output"), seed=1
    )
    replay(LLMEngine(config, share=base), warm)
    engine = LLMEngine(config, share=base)
    before = time_probe(base.runner, points) if points else None
    with StepRecorder(engine) as recorder:
        measured = replay(engine, trace)
    around = mean_probe(before, time_probe(base.runner, points)) if before and points else None
    steps = [step.sample() for step in recorder.steps() if step.cycle_ms is not None]
    return _Replay(tuple(measured), engine.scheduler.config, summarize(measured, time_unit="s"), steps, around)


def batch_kind(step: StepSample) -> tuple[int, str]:
    """(order, label) of a step's kind: its decode count's power-of-two bin (``1 decode``, ``2-3
    decodes``, ...) in order, then ``with prefill``."""
    if step.num_prefill_tokens:
        return 1 << 30, "with prefill"
    low = 1 << (step.num_decode_tokens.bit_length() - 1)
    return low, "1 decode" if low == 1 else f"{low}-{2 * low - 1} decodes"


def _by_batch(prices: list[float], steps: list[StepSample]) -> dict[str, ErrorStats]:
    kinds: dict[tuple[int, str], tuple[list[float], list[StepSample]]] = {}
    for price, step in zip(prices, steps, strict=True):
        found = kinds.setdefault(batch_kind(step), ([], []))
        found[0].append(price)
        found[1].append(step)
    return {label: predicted_error_stats(*kinds[(order, label)]) for order, label in sorted(kinds)}


def _values(summary: dict[str, object]) -> dict[str, float]:
    return {key: _number(summary, key) for key, _, _ in METRICS}


def _median_replay(rows: list[MetricRow]) -> MetricRow:
    """The row of the replay whose error is the median; for an even count, the mean of the two
    middle replays' predictions and measurements (a non-finite error counts as 0)."""
    ranked = sorted(rows, key=lambda r: r.rel_error if math.isfinite(r.rel_error) else 0.0)
    low, high = ranked[(len(ranked) - 1) // 2], ranked[len(ranked) // 2]
    return MetricRow(low.key, low.label, low.unit, (low.predicted + high.predicted) / 2,
                     (low.measured + high.measured) / 2)  # fmt: skip


def _span(requests: tuple[Any, ...], what: str) -> tuple[int, int]:
    lengths = [r.num_prompt_tokens if what == "prompt" else r.num_output_tokens for r in requests] or [1]
    return min(lengths), max(lengths)


def _number(summary: dict[str, object], key: str) -> float:
    value = summary.get(key)
    return float(value) if isinstance(value, int | float) else float("nan")


def format_by_batch(by_batch: dict[str, ErrorStats]) -> str:
    """``1 decode +5.0% (120), ...``: the error on the total time of each kind of step (its steps)."""
    return ", ".join(f"{kind} {100 * e.total:+.1f}% ({e.num_samples})" for kind, e in by_batch.items())


def format_speeds(speeds: tuple[Speed, ...]) -> str:
    """``x1.020, x0.950/x1.100``: one replay's speed, or its decode-only/prefill speeds apart."""
    return ", ".join(f"x{d:.3f}" if d == p else f"x{d:.3f}/x{p:.3f}" for d, p in speeds)


def format_validation(validation: Validation) -> str:
    """One table: metric, predicted, measured, relative error (and, over several replays, the
    measured spread: (max - min) / median)."""
    replays = validation.replays
    header = ("metric", "predicted", "measured", "error") + (("replay spread",) if len(replays) > 1 else ())
    lines: list[tuple[str, ...]] = []
    for r in validation.rows:
        line: tuple[str, ...] = (
            f"{r.label} ({r.unit})",
            f"{r.predicted:.4g}",
            f"{r.measured:.4g}",
            f"{100 * r.rel_error:+.1f}%",
        )
        if len(replays) > 1:
            values = [v[r.key] for v in replays]
            spread = (max(values) - min(values)) / r.measured if r.measured else 0.0
            line += (f"{100 * spread:.1f}%",)
        lines.append(line)
    widths = [max(len(row[i]) for row in (header, *lines)) for i in range(len(header))]
    text = [
        "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
        for row in (header, *lines)
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    e = validation.step_error
    measured = f"per row, the replay of median error of {len(replays)}" if len(replays) > 1 else "one engine replay"
    text.append(
        f"\nmeasured: {measured}. step times ({e.num_samples} engine steps, predicted / measured - 1): "
        f"mean {100 * e.bias:+.1f}%, on their total time {100 * e.total:+.1f}%, mean |error| {100 * e.mean_abs:.1f}%, "
        f"p90 |error| {100 * e.p90_abs:.1f}%"
    )
    if validation.step_error_by_batch:
        text.append("step error on total time, by kind (steps): " + format_by_batch(validation.step_error_by_batch))
    if validation.speeds:
        found = format_speeds(validation.speeds)
        text.append(f"machine speed ({validation.speed_source}; step times against calibration), per replay: {found}")
    else:
        text.append("predicted at the speed of the calibration run")
    return "\n".join(text)
