"""Capacity curves: throughput, goodput and latency percentiles against the offered request rate.

Input: per run (a line), a list of ``(rate, summary)`` points, `summary` being a
`contbatch.metrics.summarize` dict (plus anything else; only its keys are read). Four panels:
request throughput and, when the summaries have an SLO, goodput; then the p50 / p90 / p99 of
TTFT, TPOT and E2E (the summary's ``median_*``, ``p90_*``, ``p99_*`` keys, in their unit: ms
for a seconds clock, ticks for a tick clock). A missing or None value leaves a gap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contbatch.metrics.stats import latency_suffix
from contbatch.plots._figure import axes_list, new_figure, run_color, save

PERCENTILE_STYLES: tuple[tuple[str, str, str], ...] = (
    ("median", "p50", "-"),
    ("p90", "p90", "--"),
    ("p99", "p99", ":"),
)
LATENCY_PANELS: tuple[tuple[str, str], ...] = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
CapacityCurves = Mapping[str, Sequence[tuple[float, Mapping[str, object]]]]


def _value(summary: Mapping[str, object], key: str) -> float:
    value = summary.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else float("nan")


def _time_unit(curves: CapacityCurves) -> str:
    units = {str(s.get("time_unit", "s")) for points in curves.values() for _, s in points}
    if len(units) != 1:
        raise ValueError(f"capacity curves mix time units: {sorted(units)}")
    return units.pop()


def _throughput_panel(ax: Any, curves: CapacityCurves, unit: str) -> None:
    has_goodput = any(s.get("goodput") is not None for points in curves.values() for _, s in points)
    for index, points in enumerate(curves.values()):
        ordered = sorted(points, key=lambda p: p[0])
        rates = [rate for rate, _ in ordered]
        color = run_color(index)
        ax.plot(rates, [_value(s, "request_throughput") for _, s in ordered], "o-", color=color, markersize=3)
        if has_goodput:
            ax.plot(rates, [_value(s, "goodput") for _, s in ordered], "s--", color=color, markersize=3)
    ax.plot([], [], "ko-", markersize=3, label="throughput")
    if has_goodput:
        ax.plot([], [], "ks--", markersize=3, label="goodput")
    ax.set_title("throughput" + (" and goodput" if has_goodput else ""), fontsize=10)
    ax.set_ylabel(f"requests / {unit}")
    ax.legend(fontsize=7)


def _latency_panel(ax: Any, curves: CapacityCurves, name: str, title: str, suffix: str) -> None:
    for index, (_, points) in enumerate(curves.items()):
        ordered = sorted(points, key=lambda p: p[0])
        rates = [rate for rate, _ in ordered]
        for prefix, _, style in PERCENTILE_STYLES:
            values = [_value(s, f"{prefix}_{name}_{suffix}") for _, s in ordered]
            ax.plot(rates, values, style, marker="o", markersize=3, color=run_color(index))
    for _, shown, style in PERCENTILE_STYLES:
        ax.plot([], [], style, color="k", label=shown)
    ax.set_title(f"{title} percentiles", fontsize=10)
    ax.set_ylabel(f"{title} ({suffix})")
    ax.legend(fontsize=7)


def _run_legend(figure: Any, labels: list[str], title: str | None) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=run_color(i), linewidth=2) for i in range(len(labels))]
    figure.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=min(4, len(labels)),
        fontsize=8,
        title=title,
        title_fontsize=8,
        frameon=False,
    )


def plot_capacity(
    curves: CapacityCurves,
    out_dir: str | Path,
    *,
    stem: str = "capacity",
    title: str | None = None,
    legend_title: str | None = None,
) -> tuple[Path, Path]:
    """Throughput/goodput and TTFT/TPOT/E2E percentiles against rate, one colour per run
    (labelled by the keys of `curves`, under `legend_title`). Writes ``stem.png`` and
    ``stem.svg``; returns their paths."""
    if not curves or any(not points for points in curves.values()):
        raise ValueError("plot_capacity needs at least one run, each with at least one (rate, summary) point")
    time_unit = _time_unit(curves)
    unit = "s" if time_unit == "s" else "tick"
    figure = new_figure(11.0, 7.5)
    panels = axes_list(figure.subplots(2, 2, sharex=True))
    _throughput_panel(panels[0], curves, unit)
    for ax, (name, label) in zip(panels[1:], LATENCY_PANELS, strict=True):
        _latency_panel(ax, curves, name, label, latency_suffix(time_unit))
    for ax in panels:
        ax.grid(alpha=0.35, linewidth=0.6)
        ax.set_ylim(bottom=0)
    for ax in panels[2:]:
        ax.set_xlabel(f"request rate (requests / {unit})")
    _run_legend(figure, list(curves), legend_title)
    if title:
        figure.suptitle(title, fontsize=11)
    return save(figure, out_dir, stem)
