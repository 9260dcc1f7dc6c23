"""Latency CDFs: the empirical distribution of TTFT, TPOT and E2E per request, one line per run.

The latencies are `contbatch.metrics.request_metrics`'s (the definitions live there), shown in
the unit the summary keys use: milliseconds for a seconds clock, ticks for a tick clock. The
requests drawn are the summary's: those that ran (`RequestMetrics.ran`; a rejected request is in
no panel), each in the panels whose latency it has (no token: no TTFT; fewer than two tokens: no
TPOT). SLO thresholds, when given, are drawn as dashed lines. The x axes are linear, with at
most seven round ticks a panel and compact labels (``125k`` ms), fewer where labels would touch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, per_request_table
from contbatch.metrics.stats import latency_scale, latency_suffix
from contbatch.plots._figure import axes_list, new_figure, readable_x_ticks, run_color, save

LATENCIES: tuple[tuple[str, str], ...] = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency"))


def latency_samples(timelines: Sequence[Timeline], time_unit: str) -> dict[str, list[float]]:
    """{"ttft"|"tpot"|"e2e": sorted values in the summary-key unit} of finished timelines,
    over the requests that ran, as every summary latency is."""
    scale = latency_scale(time_unit)
    rows = [m for m in per_request_table(timelines) if m.ran]
    found: dict[str, list[float]] = {}
    for name, _ in LATENCIES:
        values = [getattr(m, name) for m in rows]
        found[name] = sorted(v * scale for v in values if v is not None)
    return found


def _ecdf(ax: Any, values: list[float], color: str, label: str) -> None:
    n = len(values)
    xs = [values[0], *values]
    ys = [0.0, *((i + 1) / n for i in range(n))]
    ax.step(xs, ys, where="post", color=color, linewidth=1.6, label=label)


def plot_latency_cdfs(
    runs: Mapping[str, Sequence[Timeline]],
    out_dir: str | Path,
    *,
    time_unit: str,
    slo: SLO | None = None,
    stem: str = "latency-cdf",
) -> tuple[Path, Path]:
    """TTFT, TPOT and E2E CDFs side by side, one line per run (label → finished timelines).
    Writes ``stem.png`` and ``stem.svg``; returns their paths."""
    if not runs:
        raise ValueError("plot_latency_cdfs needs at least one run")
    samples = {label: latency_samples(timelines, time_unit) for label, timelines in runs.items()}
    unit = latency_suffix(time_unit)
    figure = new_figure(12.0, 3.8)
    panels = axes_list(figure.subplots(1, len(LATENCIES), sharey=True, squeeze=False))
    for ax, (name, title) in zip(panels, LATENCIES, strict=True):
        drawn = False
        for index, (label, found) in enumerate(samples.items()):
            if found[name]:
                _ecdf(ax, found[name], run_color(index), label)
                drawn = True
        limit = None if slo is None else getattr(slo, name)
        if limit is not None:
            ax.axvline(limit * latency_scale(time_unit), color="#444444", linestyle="--", linewidth=1, label="SLO")
        if not drawn:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes, color="#777777")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"{title} ({unit})")
        ax.grid(alpha=0.35, linewidth=0.6)
    panels[0].set_ylabel("fraction of requests")
    panels[0].set_ylim(0.0, 1.02)
    panels[0].legend(fontsize=8, loc="lower right")
    readable_x_ticks(figure, panels)  # at most 7 round ticks a panel, "125k" not "125000": no overlap
    return save(figure, out_dir, stem)
