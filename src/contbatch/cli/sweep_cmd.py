"""`contbatch sweep CONFIG.yaml`: a grid of simulator runs from one YAML file (`contbatch.sweep`).

Flags: ``--workers N`` (parallel processes, or Ray CPUs with ``--ray local``), ``--ray
ADDRESS|auto|local`` (run the points as Ray tasks), ``--out DIR`` (write sweep.csv and
sweep.json), ``--plot DIR`` (the plot metric across the grid, and capacity curves when rate is
an axis), ``--metric NAME`` (the metric to plot, overriding the file's), ``--json`` (print the
JSON document instead of the text table), ``--progress`` / ``--no-progress``.

A bad file or flag is a `UsageError`: one line on stderr naming the file and key (or the flag),
exit code 2, as for ``simulate`` and ``compare``. Points whose simulation stalls are reported
in their rows (``error``) and on stderr; the command still exits 0. A Ray cluster that cannot be
reached exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contbatch.cli.options import UsageError

if TYPE_CHECKING:  # contbatch.sweep (and yaml) load only when the subcommand runs
    from contbatch.sweep import SweepResult, SweepSpec


def add_sweep_parser(commands: Any) -> None:
    """Register ``sweep`` on the subparsers object of the main parser."""
    sweep = commands.add_parser(
        "sweep",
        help="run a grid of configurations from a YAML file, one results table",
        description="Run every point of a parameter grid (YAML) through the simulator; write one results table.",
    )
    sweep.add_argument("config", type=Path, metavar="CONFIG.yaml", help="the sweep file (see examples/sweep.yaml)")
    sweep.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run points as Ray tasks: 'local' starts Ray here, 'auto' joins this machine's cluster, "
        "else a cluster address such as ray://head:10001",
    )
    sweep.add_argument(
        "--workers", type=int, metavar="N", help="parallel worker processes (default: one per CPU; 1: in-process)"
    )
    sweep.add_argument("--out", type=Path, metavar="DIR", help="write sweep.csv and sweep.json here")
    sweep.add_argument("--plot", type=Path, metavar="DIR", help="write plots of the results here (PNG and SVG)")
    sweep.add_argument("--metric", help="the metric to plot (default: the file's plot.metric)")
    sweep.add_argument("--json", action="store_true", help="print the results as JSON")
    sweep.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, help="progress bar on stderr (default: on a terminal)"
    )


def _spec(args: argparse.Namespace) -> SweepSpec:
    from contbatch.sweep import SweepError, load_sweep, with_plot_metric

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    try:
        spec = load_sweep(args.config)
    except SweepError as exc:
        raise UsageError(str(exc)) from None
    if args.metric:
        try:
            spec = with_plot_metric(spec, args.metric)
        except ValueError as exc:
            raise UsageError(f"--metric: {exc}") from None
    return spec


def _run(spec: SweepSpec, args: argparse.Namespace) -> SweepResult:
    from contbatch.sweep import RayUnavailable, run_local, run_ray

    if args.ray is None:
        return run_local(spec, workers=args.workers, progress=args.progress)
    try:
        return run_ray(spec, address=args.ray, workers=args.workers, progress=args.progress)
    except RayUnavailable as exc:
        raise UsageError(str(exc)) from None


def run_sweep_command(args: argparse.Namespace) -> int:
    """The ``sweep`` subcommand; returns the exit code."""
    from contbatch.sweep import document, text_table, to_json, write_results, write_sweep_plots

    try:
        spec = _spec(args)
        result = _run(spec, args)
    except UsageError as exc:
        print(f"contbatch sweep: error: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"contbatch sweep: cannot reach the Ray cluster: {exc}", file=sys.stderr)
        return 1
    if args.out is not None:
        write_results(result, args.out)
    if args.plot is not None and not write_sweep_plots(result, args.plot):
        print("contbatch sweep: --plot: nothing to plot, the sweep has no grid axes", file=sys.stderr)
    if result.num_failed:
        print(f"contbatch sweep: {result.num_failed} point(s) did not run to the end; see 'error'", file=sys.stderr)
    print(to_json(document(result)) if args.json else text_table(result))  # (a reader gone away: `main`)
    return 0
