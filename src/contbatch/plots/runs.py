"""The plots of one `simulate` / `compare` invocation, written together into one directory.

`write_run_plots` draws, for runs of the same trace: the request timeline (only when the trace
has at most `MAX_TIMELINE_REQUESTS` requests: beyond that one bar per request stops being
readable), the latency CDFs, and, when step records are given, KV usage and batch size over time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO
from contbatch.plots.cdf import plot_latency_cdfs
from contbatch.plots.steps import StepPoint, plot_steps
from contbatch.plots.timeline import plot_request_timeline

MAX_TIMELINE_REQUESTS = 64


def write_run_plots(
    runs: Mapping[str, Sequence[Timeline]],
    out_dir: str | Path,
    *,
    time_unit: str,
    steps: Mapping[str, Sequence[StepPoint]] | None = None,
    slo: SLO | None = None,
    title: str | None = None,
) -> list[Path]:
    """Every plot that fits these runs; returns the files written (PNG and SVG of each)."""
    written: list[Path] = []
    if max(len(t) for t in runs.values()) <= MAX_TIMELINE_REQUESTS:
        written += plot_request_timeline(runs, out_dir, time_unit=time_unit, title=title)
    written += plot_latency_cdfs(runs, out_dir, time_unit=time_unit, slo=slo)
    if steps:
        written += plot_steps(steps, out_dir, time_unit=time_unit)
    return written
