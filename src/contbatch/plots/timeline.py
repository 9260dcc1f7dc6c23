"""The request timeline: one horizontal bar per request, split into the phases of its timeline.

Phases, from the events of `contbatch.core.timeline.Timeline` (each bar segment is one of them):

- ``waiting``  = ARRIVED → first SCHEDULED (the whole life of a request never scheduled);
- ``requeued`` = PREEMPTED → next SCHEDULED (or FINISHED): waiting again after a preemption;
- ``prefill``  = SCHEDULED → first TOKENS, while running;
- ``decode``   = first TOKENS → PREEMPTED or FINISHED, while running (recomputation after a
  preemption that follows the first token counts as decode: the timeline cannot tell them apart).

Invariants of `request_segments`: segments are in time order, do not overlap, have positive
length, and cover ARRIVED → FINISHED exactly (zero-length phases are left out). Token emissions
are drawn as ticks when a run is small enough to read them. Several runs of the same trace are
drawn as panels sharing the time axis, one row per request in trace order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.plots._figure import axes_list, new_figure, save, style_time_axis, time_label

PHASES: tuple[str, ...] = ("waiting", "requeued", "prefill", "decode")
PHASE_STYLES: dict[str, dict[str, Any]] = {
    "waiting": {"color": "#d4d4d4", "edgecolor": "#9a9a9a"},
    "requeued": {"color": "#d4d4d4", "edgecolor": "#7a7a7a", "hatch": "///"},
    "prefill": {"color": "#f28e2b", "edgecolor": "#b5651d"},
    "decode": {"color": "#4e79a7", "edgecolor": "#2f4b6b"},
}
MAX_TICK_EMISSIONS = 2000  # token ticks are drawn (auto) only for runs with at most this many emissions
MAX_LABELLED_REQUESTS = 64  # request ids are written on the axis only up to this many rows


@dataclass(frozen=True, slots=True)
class Segment:
    phase: str  # one of PHASES
    start_ts: float
    end_ts: float  # > start_ts


def _end_ts(tl: Timeline) -> float:
    if tl.finished_ts is not None:
        return tl.finished_ts
    return max([tl.arrival_ts, *tl.scheduled_ts, *tl.preempted_ts, *tl.token_ts])


def _running(start: float, stop: float, first_token_ts: float | None) -> list[Segment]:
    if first_token_ts is None or first_token_ts >= stop:
        return [Segment("prefill", start, stop)]
    if first_token_ts <= start:
        return [Segment("decode", start, stop)]
    return [Segment("prefill", start, first_token_ts), Segment("decode", first_token_ts, stop)]


def request_segments(tl: Timeline) -> list[Segment]:
    """The phases of one request, in time order (an unfinished one ends at its last event)."""
    end = _end_ts(tl)
    scheduled, preempted = tl.scheduled_ts, tl.preempted_ts
    if not scheduled:
        found = [Segment("waiting", tl.arrival_ts, end)]
    else:
        found = [Segment("waiting", tl.arrival_ts, scheduled[0])]
        for k, start in enumerate(scheduled):
            stop = preempted[k] if k < len(preempted) else end
            found += _running(start, stop, tl.first_token_ts)
            if k < len(preempted):
                resume = scheduled[k + 1] if k + 1 < len(scheduled) else end
                found.append(Segment("requeued", preempted[k], resume))
    return [s for s in found if s.end_ts > s.start_ts]


def _makespan(timelines: Sequence[Timeline]) -> float:
    return max(_end_ts(tl) for tl in timelines) - min(tl.arrival_ts for tl in timelines)


def _draw_phases(ax: Any, timelines: Sequence[Timeline], labelled: set[str]) -> None:
    rows: dict[str, tuple[list[float], list[float], list[float]]] = {p: ([], [], []) for p in PHASES}
    for y, tl in enumerate(timelines):
        for seg in request_segments(tl):
            ys, lefts, widths = rows[seg.phase]
            ys.append(y)
            lefts.append(seg.start_ts)
            widths.append(seg.end_ts - seg.start_ts)
    for phase in PHASES:
        ys, lefts, widths = rows[phase]
        if not ys:
            continue
        label = phase if phase not in labelled else None
        labelled.add(phase)
        ax.barh(ys, widths, left=lefts, height=0.64, linewidth=0.6, label=label, **PHASE_STYLES[phase])


def _draw_marks(ax: Any, timelines: Sequence[Timeline], ticks: bool, labelled: set[str]) -> None:
    if ticks:
        xs = [ts for tl in timelines for ts in tl.token_ts]
        ys = [y for y, tl in enumerate(timelines) for _ in tl.token_ts]
        label = "token emitted" if "ticks" not in labelled else None
        labelled.add("ticks")
        ax.scatter(xs, ys, marker="|", s=110, color="#111111", linewidths=1.1, zorder=3, label=label)
    failed = [(tl.finished_ts, y) for y, tl in enumerate(timelines) if _failed(tl)]
    if failed:
        label = "ended unsuccessfully" if "failed" not in labelled else None
        labelled.add("failed")
        ax.scatter(*zip(*failed, strict=True), marker="x", s=40, color="#c0392b", zorder=4, label=label)


def _failed(tl: Timeline) -> bool:
    return tl.finish_reason is not None and tl.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP)


def _style_panel(ax: Any, label: str, timelines: Sequence[Timeline], time_unit: str) -> None:
    unit = "ticks" if time_unit == "tick" else time_unit
    ax.set_title(f"{label}: makespan {_makespan(timelines):g} {unit}", loc="left", fontsize=10)
    ax.set_ylim(len(timelines) - 0.5, -0.5)  # first request on top
    if len(timelines) <= MAX_LABELLED_REQUESTS:
        ax.set_yticks(range(len(timelines)), [tl.request_id for tl in timelines], fontsize=8)
    else:
        ax.set_ylabel("request (trace order)")
    ax.grid(axis="x", alpha=0.35, linewidth=0.6)
    ax.set_axisbelow(True)


LEGEND_ORDER = ("waiting", "requeued", "prefill", "decode", "token emitted", "ended unsuccessfully")


def _legend(figure: Any, panels: list[Any]) -> None:
    found: dict[str, Any] = {}
    for ax in panels:
        handles, labels = ax.get_legend_handles_labels()
        found.update(zip(labels, handles, strict=True))
    names = [n for n in LEGEND_ORDER if n in found]
    figure.legend([found[n] for n in names], names, loc="outside lower center", ncols=6, fontsize=8, frameon=False)


def plot_request_timeline(
    runs: Mapping[str, Sequence[Timeline]],
    out_dir: str | Path,
    *,
    time_unit: str = "tick",
    stem: str = "request-timeline",
    token_ticks: bool | None = None,
    title: str | None = None,
) -> tuple[Path, Path]:
    """Gantt-style bars per request, one panel per run (label → timelines), sharing the time
    axis. `token_ticks` None draws emission ticks when every run has at most
    `MAX_TICK_EMISSIONS` emissions. Writes ``stem.png`` and ``stem.svg``; returns their paths."""
    if not runs or any(not timelines for timelines in runs.values()):
        raise ValueError("plot_request_timeline needs at least one run, each with at least one timeline")
    num_rows = max(len(t) for t in runs.values())
    if token_ticks is None:
        token_ticks = all(sum(len(tl.token_ts) for tl in t) <= MAX_TICK_EMISSIONS for t in runs.values())
    panel_height = 0.9 + 0.28 * min(num_rows, 120)
    figure = new_figure(9.0, panel_height * len(runs) + 0.9)
    panels = axes_list(figure.subplots(len(runs), 1, sharex=True, squeeze=False))
    labelled: set[str] = set()
    for ax, (label, timelines) in zip(panels, runs.items(), strict=True):
        _draw_phases(ax, timelines, labelled)
        _draw_marks(ax, timelines, token_ticks, labelled)
        _style_panel(ax, label, timelines, time_unit)
    start = min(tl.arrival_ts for t in runs.values() for tl in t)
    end = max(_end_ts(tl) for t in runs.values() for tl in t)
    panels[-1].set_xlim(start, end + 0.02 * max(end - start, 1e-9))
    panels[-1].set_xlabel(time_label(time_unit))
    style_time_axis(panels[-1], time_unit)
    _legend(figure, panels)
    if title:
        figure.suptitle(title, fontsize=11)
    return save(figure, out_dir, stem)
