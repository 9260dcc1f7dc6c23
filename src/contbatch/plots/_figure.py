"""Figure plumbing shared by every plot: a headless figure, and writing it as PNG and SVG.

matplotlib is imported here, inside the functions, never at module import time, so importing
`contbatch.plots` stays cheap and free of it. Figures are drawn with the Agg canvas directly
(`matplotlib.figure.Figure` + `FigureCanvasAgg`): pyplot and its global backend are never
touched, so plotting works without a display, in threads and in notebooks alike, and leaves
no figure registered anywhere. SVG output carries no date and a fixed hash salt, so the same
data gives the same bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# One colour per run (the colour-blind-safe Tableau 10 order), reused by every plot.
RUN_COLORS: tuple[str, ...] = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)

UNIT_LABELS = {"s": "s", "tick": "ticks"}


def run_color(index: int) -> str:
    return RUN_COLORS[index % len(RUN_COLORS)]


def time_label(time_unit: str) -> str:
    return f"time ({UNIT_LABELS.get(time_unit, time_unit)})"


def style_time_axis(ax: Any, time_unit: str) -> None:
    """Whole ticks on a tick clock (every tick when the span is short)."""
    from matplotlib.ticker import MaxNLocator, MultipleLocator

    if time_unit != "tick":
        return
    low, high = ax.get_xlim()
    ax.xaxis.set_major_locator(MultipleLocator(1) if high - low <= 24 else MaxNLocator(integer=True))


_SCALES: tuple[tuple[float, float, str], ...] = ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k"))
_LABEL_GAP_PX = 4.0  # the least room between two neighbouring tick labels, in pixels


def compact_label(value: float, ticks: Sequence[float] = ()) -> str:
    """Short text for the tick at `value` among `ticks`: ``0``, ``0.25``, ``12.5``, ``1500``,
    ``25k``, ``125k``, ``1.5M``.

    The ticks of one axis share a scale (set by the largest: thousands ``k`` from 10,000,
    millions ``M``, billions ``G``) and a number of decimals (the fewest that write every tick
    exactly, at most 6), so neighbouring labels are short, aligned and never equal. Zero is
    ``0``; a negative value has a true minus sign.
    """
    every = [*ticks, value]
    top = max(abs(v) for v in every)
    divisor, suffix = next(((d, name) for limit, d, name in _SCALES if top >= limit), (1.0, ""))
    scaled = [v / divisor for v in every]
    decimals = next(
        (d for d in range(7) if all(abs(round(v, d) - v) <= 1e-9 * max(1.0, abs(v)) for v in scaled)),
        6,
    )
    text = f"{value / divisor:.{decimals}f}"
    if float(text) == 0:
        return "0"
    return text.replace("-", "\N{MINUS SIGN}") + suffix


def readable_x_ticks(figure: Figure, panels: list[Any], *, max_ticks: int = 7) -> None:
    """Round x ticks with compact labels (`compact_label`: no offset, no ``1e8`` multiplier) on
    every panel, at most `max_ticks` of them, then fewer wherever two labels would still touch.

    The check measures the drawn labels (`Text.get_window_extent` after a draw), so it holds
    for any figure width, font size and value range: no two tick labels of a panel overlap.
    """
    from matplotlib.ticker import MaxNLocator

    def locator(bins: int) -> MaxNLocator:
        return MaxNLocator(nbins=bins, steps=[1, 2, 2.5, 5, 10])

    bins = {id(ax): max(1, max_ticks - 1) for ax in panels}  # intervals: ticks <= bins + 1
    for ax in panels:
        ax.xaxis.set_major_locator(locator(bins[id(ax)]))
        ax.xaxis.set_major_formatter(_compact_formatter())
    while True:
        figure.canvas.draw()
        crowded = [ax for ax in panels if bins[id(ax)] > 1 and _labels_overlap(ax, figure)]
        if not crowded:
            return
        for ax in crowded:
            bins[id(ax)] -= 1
            ax.xaxis.set_major_locator(locator(bins[id(ax)]))


def _compact_formatter() -> Any:
    """A tick formatter writing `compact_label` of each tick among the ticks being labelled."""
    from matplotlib.ticker import Formatter

    class CompactFormatter(Formatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return compact_label(x)

        def format_ticks(self, values: list[float]) -> list[str]:
            ticks = list(values)
            return [compact_label(value, ticks) for value in ticks]

    return CompactFormatter()


def shown_x_tick_labels(ax: Any) -> list[Any]:
    """The x tick labels drawn on `ax`: visible, non-empty, at a tick inside the view limits."""
    low, high = sorted(ax.get_xlim())
    return [
        label
        for label in ax.get_xticklabels()
        if label.get_visible() and label.get_text() and low <= label.get_position()[0] <= high
    ]


def _labels_overlap(ax: Any, figure: Figure) -> bool:
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = sorted((label.get_window_extent(renderer) for label in shown_x_tick_labels(ax)), key=lambda box: box.x0)
    return any(right.x0 - left.x1 < _LABEL_GAP_PX for left, right in itertools.pairwise(boxes))


def new_figure(width: float, height: float) -> Figure:
    """A figure on an Agg canvas, outside pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save(figure: Figure, out_dir: str | Path, stem: str) -> tuple[Path, Path]:
    """Write `figure` to ``out_dir/stem.png`` and ``out_dir/stem.svg`` (creating `out_dir`)."""
    import matplotlib

    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    png, svg = directory / f"{stem}.png", directory / f"{stem}.svg"
    with matplotlib.rc_context({"svg.hashsalt": "contbatch"}):
        figure.savefig(png, dpi=120)
        figure.savefig(svg, metadata={"Date": None})
    return png, svg


def axes_list(found: Any) -> list[Any]:
    """`Figure.subplots` gives one Axes or an array of them; always a flat list."""
    try:
        return list(found.flat)
    except AttributeError:
        return [found]
