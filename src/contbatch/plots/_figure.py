"""Figure plumbing shared by every plot: a headless figure, and writing it as PNG and SVG.

matplotlib is imported here, inside the functions, never at module import time, so importing
`contbatch.plots` stays cheap and free of it. Figures are drawn with the Agg canvas directly
(`matplotlib.figure.Figure` + `FigureCanvasAgg`): pyplot and its global backend are never
touched, so plotting works without a display, in threads and in notebooks alike, and leaves
no figure registered anywhere. SVG output carries no date and a fixed hash salt, so the same
data gives the same bytes.
"""

from __future__ import annotations

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
