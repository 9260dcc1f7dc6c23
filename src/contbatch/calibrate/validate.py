"""`validate`: the real engine and the calibrated simulator on one trace, metric by metric.

1. The engine runs the trace in real time (`contbatch run`'s replay), after a short warm-up run
   on an engine that shares the model (first steps pay one-off allocation costs), `replays`
   times on fresh engines: each measured metric is the median over the replays (a real-time
   measurement on a shared machine drifts by several percent from one minute to the next, and
   queueing near capacity amplifies it), and every replay's values are kept;
2. the simulator runs the same trace with the profile's cost model and *the scheduler config the
   engine ran with* (its KV block count and block size, max_model_len, every budget), the same
   scheduler kind;
3. both sets of timelines are summarised by `contbatch.metrics.summarize`, and each metric of
   `METRICS` is compared: relative error = predicted / measured - 1;
4. each engine step's cycle time (`contbatch.calibrate.loop`) is compared with the cost model's
   price of that very step: the step-level error, which tells a wrong cost model from
   queueing that amplifies a small one.

A trace named ``calibration`` is refused: the calibration run used it, so it proves nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from contbatch.calibrate.calibration import CALIBRATION_TRACE
from contbatch.calibrate.capacity import workload
from contbatch.calibrate.fit import ErrorStats, StepSample, error_stats
from contbatch.calibrate.loop import StepRecorder
from contbatch.core import SchedulerConfig, Timeline, make_scheduler
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.engine.replay import replay
from contbatch.metrics import summarize
from contbatch.sim.cost import CostModel
from contbatch.sim.loop import simulate
from contbatch.traces import Trace

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
            "measured_replays": list(self.replays),
            "measured": self.measured_summary,
            "predicted": self.predicted_summary,
        }  # fmt: skip


def validate(
    config: EngineConfig, cost: CostModel, trace: Trace, *, engine: LLMEngine | None = None, replays: int = 1
) -> Validation:
    """Run `trace` on the engine `replays` times (fresh engines sharing `engine`'s model when
    given) and once in the simulator. Measured metrics are medians over the replays; the
    measured timelines and summary are those of the median replay (by mean E2E)."""
    if trace.name == CALIBRATION_TRACE:
        raise ValueError(f"trace {trace.name!r} is the calibration workload: validate on another trace")
    if cost.time_unit != "s" or trace.time_unit != "s":
        raise ValueError("validation needs a cost model and a trace in seconds")
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    base = engine or LLMEngine(config)
    runs = [_replay(base, config, trace) for _ in range(replays)]
    values = tuple({key: _number(summary, key) for key, _, _ in METRICS} for _, _, summary, _ in runs)
    ordered = sorted(runs, key=lambda run: _number(run[2], "mean_e2el_ms"))
    measured, scheduler_config, measured_summary, _ = ordered[(len(ordered) - 1) // 2]
    steps = [step for *_, run_steps in runs for step in run_steps]
    step_error = error_stats(lambda step: cost.step_time(step.to_output()) * 1000.0, steps)
    result = simulate(trace, make_scheduler(config.scheduler_kind, scheduler_config), cost)
    predicted_summary = result.summary()
    rows = tuple(
        MetricRow(key, label, unit, _number(predicted_summary, key), statistics.median(v[key] for v in values))
        for key, label, unit in METRICS
    )
    return Validation(
        trace, rows, measured, result.timelines, measured_summary, predicted_summary, step_error, tuple(steps), values
    )


def _replay(
    base: LLMEngine, config: EngineConfig, trace: Trace
) -> tuple[tuple[Timeline, ...], SchedulerConfig, dict[str, object], list[StepSample]]:
    """One warmed-up real-time replay on a fresh engine: timelines, the scheduler config it ran
    with, their summary, its steps with their cycle times."""

    head = trace.requests[:4]
    warm = workload(
        "warm-up", len(head), 100.0, prompt_tokens=_span(head, "prompt"), output_tokens=_span(head, "output"), seed=1
    )
    replay(LLMEngine(config, share=base), warm)
    engine = LLMEngine(config, share=base)
    with StepRecorder(engine) as recorder:
        measured = replay(engine, trace)
    steps = [step.sample() for step in recorder.steps() if step.cycle_ms is not None]
    return tuple(measured), engine.scheduler.config, summarize(measured, time_unit="s"), steps


def _span(requests: tuple[Any, ...], what: str) -> tuple[int, int]:
    lengths = [r.num_prompt_tokens if what == "prompt" else r.num_output_tokens for r in requests] or [1]
    return min(lengths), max(lengths)


def _number(summary: dict[str, object], key: str) -> float:
    value = summary.get(key)
    return float(value) if isinstance(value, int | float) else float("nan")


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
    measured = f"medians of {len(replays)} engine replays" if len(replays) > 1 else "one engine replay"
    text.append(
        f"\nmeasured: {measured}. step times ({e.num_samples} engine steps, predicted / measured - 1): "
        f"mean {100 * e.bias:+.1f}%, mean |error| {100 * e.mean_abs:.1f}%, p90 |error| {100 * e.p90_abs:.1f}%"
    )
    return "\n".join(text)
