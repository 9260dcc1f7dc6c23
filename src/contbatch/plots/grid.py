"""One metric across a parameter grid (`contbatch.sweep` results).

Input: the sweep's rows (dicts holding each axis's value and the metric) and its axis names.
Layout: the x axis is `x` (default: ``rate`` when it is an axis, else the last axis); with two
or more other axes the first of them makes one panel per value and the rest one line per
combination; with one other axis, one line per value. Values keep their first-appearance (grid)
order. A numeric x axis is drawn to scale, any other as evenly spaced categories. Rows whose
metric is missing or None leave a gap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contbatch.plots._figure import axes_list, new_figure, run_color, save


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else float("nan")


def _ordered(values: Sequence[object]) -> list[object]:
    seen: list[object] = []
    for value in values:
        if value not in seen:
            seen.append(value)
    return seen


def _shown(value: object) -> str:
    if isinstance(value, list | tuple):
        return "/".join(str(v) for v in value)
    return str(value)


def _key(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def grid_layout(axes: Sequence[str], x: str | None) -> tuple[str, str | None, tuple[str, ...]]:
    """(x axis, panel axis or None, line axes) for a grid of `axes`."""
    if not axes:
        raise ValueError("a grid plot needs at least one axis")
    chosen = x if x is not None else ("rate" if "rate" in axes else axes[-1])
    if chosen not in axes:
        raise ValueError(f"x axis {chosen!r} is not one of the grid axes: {', '.join(axes)}")
    others = tuple(a for a in axes if a != chosen)
    if len(others) >= 2:
        return chosen, others[0], others[1:]
    return chosen, None, others


def _draw_lines(ax: Any, rows: Sequence[Mapping[str, object]], x: str, lines: tuple[str, ...], metric: str) -> None:
    x_values = _ordered([_key(r[x]) for r in rows])
    numeric = all(_is_number(v) for v in x_values)
    groups: list[tuple[object, ...]] = []
    for r in rows:
        group = tuple(_key(r[a]) for a in lines)
        if group not in groups:
            groups.append(group)
    for index, group in enumerate(groups):
        members = [r for r in rows if tuple(_key(r[a]) for a in lines) == group]
        xs = [_number(r[x]) if numeric else float(x_values.index(_key(r[x]))) for r in members]
        ys = [_number(r.get(metric)) for r in members]
        label = ", ".join(f"{a}={_shown(v)}" for a, v in zip(lines, group, strict=True)) or metric
        ax.plot(xs, ys, "o-", color=run_color(index), markersize=4, linewidth=1.4, label=label)
    if not numeric:
        ax.set_xticks(range(len(x_values)), [_shown(v) for v in x_values])


def plot_grid_metric(
    rows: Sequence[Mapping[str, object]],
    axes: Sequence[str],
    metric: str,
    out_dir: str | Path,
    *,
    x: str | None = None,
    stem: str | None = None,
    title: str | None = None,
) -> tuple[Path, Path]:
    """`metric` of every grid point against the `x` axis (see the module docstring for the
    layout). Writes ``stem.png`` and ``stem.svg`` (default stem ``sweep-<metric>``)."""
    if not rows:
        raise ValueError("plot_grid_metric needs at least one row")
    x_axis, panel_axis, lines = grid_layout(axes, x)
    panel_values = _ordered([_key(r[panel_axis]) for r in rows]) if panel_axis else [None]
    figure = new_figure(max(6.0, 4.2 * len(panel_values)), 4.4)
    panels = axes_list(figure.subplots(1, len(panel_values), sharey=True, squeeze=False))
    for ax, value in zip(panels, panel_values, strict=True):
        members = [r for r in rows if panel_axis is None or _key(r[panel_axis]) == value]
        _draw_lines(ax, members, x_axis, lines, metric)
        if panel_axis is not None:
            ax.set_title(f"{panel_axis}={_shown(value)}", fontsize=10)
        ax.set_xlabel(x_axis)
        ax.grid(alpha=0.35, linewidth=0.6)
    panels[0].set_ylabel(metric)
    panels[0].legend(fontsize=7)
    if title:
        figure.suptitle(title, fontsize=11)
    return save(figure, out_dir, stem or f"sweep-{metric}")
