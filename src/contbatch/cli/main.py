"""The `contbatch` command line: `simulate`, `compare`, `capacity`, `sweep`, `serve`, `route`, `bench`,
`observe` and `fit`.

Bad input (unknown names, bad values, unreadable traces) is answered with one line on stderr
and exit code 2; a failure inside a run with exit code 1 and its message, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from contbatch import __version__
from contbatch.cli.bench_cmd import add_bench_parser, run_bench_command
from contbatch.cli.calibrate_cmd import add_calibrate_parsers, run_calibrate_command, run_validate_command
from contbatch.cli.capacity_cmd import add_capacity_parser, run_capacity_command
from contbatch.cli.engine_cmd import add_engine_parsers, run_generate_command, run_run_command
from contbatch.cli.observe_cmd import add_observe_parsers, run_fit_command, run_observe_command
from contbatch.cli.options import UsageError, add_run_flags, add_vary_flags, resolve
from contbatch.cli.report import run_all, to_document, to_json, to_text, write_out_dir
from contbatch.cli.route_cmd import add_route_parser, run_route_command
from contbatch.cli.serve_cmd import add_serve_parser, run_serve_command
from contbatch.cli.sweep_cmd import add_sweep_parser, run_sweep_command
from contbatch.sim.loop import SimulationStalled


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="contbatch",
        description="Continuous batching, measured: simulate LLM serving schedulers on a trace.",
    )
    parser.add_argument("--version", action="version", version=f"contbatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    simulate = commands.add_parser(
        "simulate", help="run one scheduler on a trace", description="Run one scheduler on a trace and summarise it."
    )
    simulate.add_argument("--scheduler", default="continuous", help="continuous (default) or static")
    add_run_flags(simulate)
    compare = commands.add_parser(
        "compare",
        help="run several schedulers on the same trace, one table",
        description="Run several schedulers on the same trace, cost model and config; print one table.",
    )
    compare.add_argument(
        "--schedulers",
        help="comma-separated scheduler names (default: static,continuous; with --vary, --admission or --policy: "
        "continuous)",
    )
    add_run_flags(compare)
    add_vary_flags(compare)
    add_capacity_parser(commands)
    add_engine_parsers(commands)
    add_calibrate_parsers(commands)
    add_sweep_parser(commands)
    add_serve_parser(commands)
    add_route_parser(commands)
    add_bench_parser(commands)
    add_observe_parsers(commands)
    return parser


def _scheduler_names(args: argparse.Namespace) -> tuple[str, ...]:
    if args.command == "simulate":
        return (args.scheduler,)
    if args.schedulers is None:
        varied = args.vary or args.admission or args.policy
        return ("continuous",) if varied else ("static", "continuous")
    return tuple(n.strip() for n in args.schedulers.split(",") if n.strip())


def _run_simulation_command(args: argparse.Namespace) -> int:
    try:
        opts = resolve(args, _scheduler_names(args))
    except UsageError as exc:
        print(f"contbatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        outcomes = run_all(opts)
    except SimulationStalled as exc:
        print(f"contbatch {args.command}: simulation failed: {exc}", file=sys.stderr)
        return 1
    document = to_document(opts, outcomes)
    write_out_dir(opts, outcomes, document)
    print(to_json(document) if opts.as_json else to_text(opts, outcomes))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": _run_simulation_command,
    "compare": _run_simulation_command,
    "capacity": run_capacity_command,
    "generate": run_generate_command,
    "run": run_run_command,
    "calibrate": run_calibrate_command,
    "validate": run_validate_command,
    "sweep": run_sweep_command,
    "serve": run_serve_command,
    "route": run_route_command,
    "bench": run_bench_command,
    "observe": run_observe_command,
    "fit": run_fit_command,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # (here, so that a reader gone away is caught below, not at exit)
        return code
    except BrokenPipeError:  # the reader left (`contbatch ... | head`): not an error, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail)
        return 0


if __name__ == "__main__":
    sys.exit(main())
