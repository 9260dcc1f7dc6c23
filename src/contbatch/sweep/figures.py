"""The plots of a sweep: its plot metric across the grid and, when ``rate`` is an axis, the
capacity curves (throughput/goodput and latency percentiles against rate, one line per
combination of the other axes); for a fleet sweep sampled over time (``fleet.sample_interval``),
each point's per-replica load and KV usage and its replica counts. Drawn by `contbatch.plots`;
failed points are left out."""

from __future__ import annotations

from pathlib import Path

from contbatch.plots import plot_capacity, plot_fleet_load, plot_grid_metric, plot_replica_count
from contbatch.sweep.results import rows
from contbatch.sweep.run import SweepResult


def _label(values: tuple[tuple[str, object], ...]) -> str:
    return ", ".join(_shown(value) for _, value in values) or "all"


def _shown(value: object) -> str:
    return "/".join(map(str, value)) if isinstance(value, tuple | list) else str(value)


def write_sweep_plots(result: SweepResult, out_dir: str | Path) -> list[Path]:
    """Every plot that fits the sweep; returns the files written (PNG and SVG of each)."""
    spec = result.spec
    written = _fleet_plots(result, out_dir)
    if not spec.axes:
        return written
    title = f"{spec.name}: {spec.trace.name}"
    written += plot_grid_metric(rows(result), spec.axis_names, spec.plot_metric, out_dir, x=spec.plot_x, title=title)
    if "rate" in spec.axis_names:
        curves: dict[str, list[tuple[float, dict[str, object]]]] = {}
        for point, summary in zip(spec.points, result.summaries, strict=True):
            if "error" in summary or point.rate is None:
                continue
            others = tuple((name, value) for name, value in point.values if name != "rate")
            curves.setdefault(_label(others), []).append((point.rate, summary))
        if curves:
            legend = ", ".join(name for name in spec.axis_names if name != "rate") or None
            written += plot_capacity(curves, out_dir, stem="sweep-capacity", title=title, legend_title=legend)
    return written


def _fleet_plots(result: SweepResult, out_dir: str | Path) -> list[Path]:
    written: list[Path] = []
    for point, summary in zip(result.spec.points, result.summaries, strict=True):
        series = summary.get("fleet_series")
        if not isinstance(series, dict):
            continue
        unit, n = result.spec.time_unit, point.index
        if series.get("load"):
            written += plot_fleet_load(series["load"], out_dir, time_unit=unit, stem=f"fleet-load-{n}")
        if series.get("pools"):
            written += plot_replica_count(series["pools"], out_dir, time_unit=unit, stem=f"fleet-replicas-{n}")
    return written
