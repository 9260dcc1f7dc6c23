"""KV usage and batch size over time, from one point per step.

`StepSeries` is a step observer (`contbatch.loop.StepObserver`): pass it to
`contbatch.sim.loop.simulate(..., observers=[series])` (or any `EngineCore`). It keeps one
`StepPoint` per step, in step order, decode runs included. A point is stamped with the step's
end time: ``kv_usage`` is the fraction of KV blocks in use while the step ran (0.0 with no KV
limit), ``num_requests`` and ``num_tokens`` are the requests and tokens the step ran, and
``duration`` is the step's time.

The plot draws each point over its step, [time - duration, time]; without a duration a step is
taken to start where the previous one ended. Batch size and tokens are 0 between steps (the
loop was idle); KV usage keeps its value (blocks stay held while nothing runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from contbatch.loop.observe import StepObserver, StepRecord
from contbatch.plots._figure import axes_list, new_figure, run_color, save, style_time_axis, time_label


class StepPoint(NamedTuple):
    time: float  # the step's end, in the run's clock
    kv_usage: float  # fraction of KV blocks in use while the step ran, in [0, 1]
    num_requests: int  # requests the step ran (its batch size)
    num_tokens: int  # tokens the step computed for requests (padding excluded)
    duration: float | None = None  # the step's time (same clock), when known


class StepSeries(StepObserver):
    """Collects a `StepPoint` per step (see the module docstring)."""

    def __init__(self) -> None:
        self.points: list[StepPoint] = []

    def on_step(self, record: StepRecord) -> None:
        out = record.out
        duration = record.end_ts - record.start_ts
        self.points.append(
            StepPoint(record.end_ts, record.kv_usage, out.num_requests, out.num_batched_tokens, duration)
        )


PANELS: tuple[tuple[int, str, float], ...] = (
    (1, "KV blocks in use (%)", 100.0),
    (2, "batch size (requests)", 1.0),
    (3, "batched tokens", 1.0),
)


def step_series(records: Sequence[Sequence[Any]], column: int, *, idle_value: bool) -> tuple[list[float], list[float]]:
    """(xs, ys) of one record column as a piecewise-constant line: each record's value over its
    step; between steps, 0 (``idle_value`` False) or the previous step's value (True)."""
    xs: list[float] = []
    ys: list[float] = []
    previous_end: float | None = None
    for record in records:
        end = float(record[0])
        duration = record[4] if len(record) > 4 else None
        start = end - float(duration) if duration is not None else (previous_end if previous_end is not None else end)
        value = float(record[column])
        if previous_end is not None and start > previous_end:
            idle = ys[-1] if idle_value else 0.0
            xs += [previous_end, start]
            ys += [idle, idle]
        xs += [start, end]
        ys += [value, value]
        previous_end = end
    return xs, ys


def plot_steps(
    runs: Mapping[str, Sequence[Sequence[Any]]],
    out_dir: str | Path,
    *,
    time_unit: str,
    stem: str = "kv-batch",
) -> tuple[Path, Path]:
    """KV usage, batch size and batched tokens against time, one line per run (label → records
    as `StepPoint` or plain (time, kv_usage, num_requests, num_tokens[, duration]) tuples). Writes
    ``stem.png`` and ``stem.svg``; returns their paths."""
    if not runs:
        raise ValueError("plot_steps needs at least one run")
    figure = new_figure(10.0, 7.0)
    panels = axes_list(figure.subplots(len(PANELS), 1, sharex=True, squeeze=False))
    for index, (label, records) in enumerate(runs.items()):
        for ax, (column, _, scale) in zip(panels, PANELS, strict=True):
            xs, ys = step_series(records, column, idle_value=column == 1)
            ax.plot(xs, [y * scale for y in ys], color=run_color(index), linewidth=1.2, label=label)
    for ax, (_, ylabel, _) in zip(panels, PANELS, strict=True):
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.35, linewidth=0.6)
        ax.set_ylim(bottom=0)
    panels[0].set_ylim(0, 105)
    panels[0].legend(fontsize=8, loc="upper right")
    panels[-1].set_xlabel(time_label(time_unit))
    style_time_axis(panels[-1], time_unit)
    return save(figure, out_dir, stem)
