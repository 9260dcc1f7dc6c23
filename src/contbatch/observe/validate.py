"""`validate --observed`: the fitted simulator against observed runs it was not fitted on.

For each run of the observation files (by default the ``open`` runs; the fit should have used
another file, or other runs), the simulator replays the run's requests at their observed send
times with the profile's cost and the scheduler the fit used (`contbatch.observe.replay`), and
every predicted chunk is moved by the fit's ``delivery_ms``. Both sides are summarised by
`contbatch.metrics.summarize` and compared metric by metric, relative error = predicted /
measured - 1, as `contbatch validate` does for the engine (`contbatch.calibrate.validate.METRICS`).

Replays: a run of the same name in several observation files is a replay of one load (the
same plan); a metric's row is the replay whose error is the median (for an even count, the mean
of the two middle replays' values), so one minute of a drifting machine decides no row; every
replay's values are kept. Machine drift (`speed_source`, the names of `contbatch validate`):
``step-kinds`` (the default) predicts each replay at the speeds its own steps, read from the
outside (`contbatch.observe.steps`), ran at against the profile, its decode-only steps' and its
steps' with a prefill apart (issue 18's method: the two drift apart); ``steps`` at one speed
from all of them;
``probe`` at the speed its speed probes found against the fit's reference
(`contbatch.observe.probe`); ``calibration`` at the fit's speed. The measured timelines arrive
at the send time (the server cannot start earlier), as the simulated ones do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contbatch.calibrate.validate import METRICS, SPEED_SOURCES, MetricRow
from contbatch.core import SchedulerConfig, make_scheduler
from contbatch.core.timeline import Timeline
from contbatch.metrics import summarize
from contbatch.observe.record import ObservedRun
from contbatch.observe.replay import probe_ms, run_trace
from contbatch.observe.steps import step_totals
from contbatch.sim.cost import CostModel
from contbatch.sim.costs.profile import ProfileCost, Speed, speeds_by_kind, whole_speed
from contbatch.sim.loop import simulate


@dataclass(frozen=True, slots=True)
class RunValidation:
    name: str
    num_requests: int
    rows: tuple[MetricRow, ...]
    measured: tuple[Timeline, ...]  # of the replay of median mean E2E
    predicted: tuple[Timeline, ...]
    replays: tuple[dict[str, float], ...]  # each replay's measured value of every METRICS key
    predicted_replays: tuple[dict[str, float], ...]
    speeds: tuple[tuple[float, float], ...] = ()  # each replay's machine speed (decode-only steps, with prefill)
    speed_source: str = "step-kinds"

    def row(self, key: str) -> MetricRow:
        return next(r for r in self.rows if r.key == key)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.name, "num_requests": self.num_requests,
            "metrics": {r.key: {"label": r.label, "unit": r.unit, "predicted": r.predicted, "measured": r.measured,
                                "rel_error": r.rel_error} for r in self.rows},
            "machine_speed_per_replay": [list(s) for s in self.speeds], "speed_source": self.speed_source,
            "measured_replays": list(self.replays), "predicted_replays": list(self.predicted_replays),
        }  # fmt: skip


def measured_timelines(run: ObservedRun) -> list[Timeline]:
    """The run's requests as timelines arriving at their send time (failed ones end ``error``)."""
    out = []
    for r in run.requests:
        timeline = Timeline(r.request_id, r.send_ts, r.num_prompt_tokens)
        timeline.record_scheduled(r.send_ts)
        for ts, n in zip(r.chunk_ts, r.chunk_tokens, strict=True):
            timeline.record_tokens(ts, n)
        timeline.record_finished(max(r.end_ts, r.chunk_ts[-1] if r.chunk_ts else r.send_ts), r.finish)
        out.append(timeline)
    return out


def shifted(timeline: Timeline, delay_s: float) -> Timeline:
    """`timeline` with its chunks (and its end) reaching the client `delay_s` later."""
    moved = Timeline(timeline.request_id, timeline.arrival_ts, timeline.num_prompt_tokens)
    for ts in timeline.scheduled_ts:
        moved.record_scheduled(ts)
    for ts, n in zip(timeline.token_ts, timeline.token_counts, strict=True):
        moved.record_tokens(ts + delay_s, n)
    if timeline.finished_ts is not None and timeline.finish_reason is not None:
        end = max(timeline.finished_ts + delay_s, moved.token_ts[-1] if moved.token_ts else timeline.finished_ts)
        moved.record_finished(end, timeline.finish_reason)
    return moved


def run_speed(
    run: ObservedRun, source: str, cost: CostModel, config: SchedulerConfig, reference_ms: float | None
) -> Speed:
    """The machine's speed during `run` by `source` (module docstring): (decode-only steps, steps
    with a prefill); 1 where the source has nothing to go by."""
    if source in ("step-kinds", "steps"):
        priced = cost.at_speed(1.0) if isinstance(cost, ProfileCost) else cost
        totals = step_totals(run, priced, config.max_num_batched_tokens)
        return speeds_by_kind(totals) if source == "step-kinds" else (whole_speed(totals),) * 2
    probe = probe_ms(run) if source == "probe" else None
    speed = 1.0 if probe is None or reference_ms is None else probe / reference_ms
    return speed, speed


def predict(
    run: ObservedRun,
    config: SchedulerConfig,
    cost: CostModel,
    delivery_ms: float,
    scheduler: str,
    *,
    speed: Speed = (1.0, 1.0),
) -> list[Timeline]:
    trace = run_trace(run)
    if trace is None:
        return []
    priced = cost.at_speed(*speed) if isinstance(cost, ProfileCost) else cost
    result = simulate(trace, make_scheduler(scheduler, config), priced)
    return [shifted(t, delivery_ms / 1000.0) for t in result.timelines]


def _values(timelines: Sequence[Timeline]) -> dict[str, float]:
    summary = summarize(timelines, time_unit="s")
    return {key: _number(summary.get(key)) for key, _, _ in METRICS}


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")


def median_row(rows: Sequence[MetricRow]) -> MetricRow:
    """The replay of median error (module docstring); a non-finite error ranks as 0."""
    ranked = sorted(rows, key=lambda r: r.rel_error if math.isfinite(r.rel_error) else 0.0)
    low, high = ranked[(len(ranked) - 1) // 2], ranked[len(ranked) // 2]
    return MetricRow(
        low.key, low.label, low.unit, (low.predicted + high.predicted) / 2, (low.measured + high.measured) / 2
    )


def validate_runs(
    replays: Sequence[ObservedRun],
    config: SchedulerConfig,
    cost: CostModel,
    *,
    delivery_ms: float,
    scheduler: str,
    speed_source: str = "step-kinds",
    reference_ms: float | None = None,
) -> RunValidation:
    """One load (`replays`: the runs of one name across files) predicted and compared, each
    replay at the machine speed `speed_source` finds (the ``probe`` source against the fit's
    `reference_ms`)."""
    if speed_source not in SPEED_SOURCES:
        raise ValueError(f"unknown speed source {speed_source!r}; known: {', '.join(SPEED_SOURCES)}")
    measured = [measured_timelines(run) for run in replays]
    speeds = tuple(run_speed(run, speed_source, cost, config, reference_ms) for run in replays)
    predicted = [
        predict(run, config, cost, delivery_ms, scheduler, speed=s) for run, s in zip(replays, speeds, strict=True)
    ]
    m_values = tuple(_values(m) for m in measured)
    p_values = tuple(_values(p) if p else {k: float("nan") for k, _, _ in METRICS} for p in predicted)
    rows = tuple(
        median_row([MetricRow(k, label, unit, p[k], m[k]) for p, m in zip(p_values, m_values, strict=True)])
        for k, label, unit in METRICS
    )
    middle = sorted(range(len(replays)), key=lambda i: m_values[i]["mean_e2el_ms"])[(len(replays) - 1) // 2]
    return RunValidation(replays[0].name, len(replays[0].requests), rows, tuple(measured[middle]),
                         tuple(predicted[middle]), m_values, p_values, speeds, speed_source)  # fmt: skip


def group_replays(files: Sequence[Sequence[ObservedRun]], kinds: Sequence[str]) -> dict[str, list[ObservedRun]]:
    """Run name -> its runs across the files (in file order), for the runs of `kinds`."""
    groups: dict[str, list[ObservedRun]] = {}
    for runs in files:
        for run in runs:
            if run.kind in kinds:
                groups.setdefault(run.name, []).append(run)
    return groups


def format_runs(results: Sequence[RunValidation], keys: Sequence[str] | None = None) -> str:
    """One table: a row per metric, a column pair (predicted / error) per run; the measured value beside."""
    chosen = [m for m in METRICS if keys is None or m[0] in keys]
    header = ["metric"] + [f"{r.name} ({len(r.replays)}x{r.num_requests})" for r in results]
    lines = [header]
    for key, label, unit in chosen:
        cells = [f"{label} ({unit})"]
        for result in results:
            row = result.row(key)
            cells.append(f"{row.predicted:.4g} / {row.measured:.4g} {100 * row.rel_error:+.1f}%")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(line)) for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append(
        "cells: predicted / measured, error = predicted / measured - 1 (per metric, the replay of median error)"
    )
    return "\n".join(text)
