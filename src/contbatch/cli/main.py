"""The `contbatch` command line: `simulate`, `compare`, `capacity`, `sweep`, `serve`, `route`, `bench`,
`observe` and `fit`.

Bad input (unknown names, bad values, unreadable traces) is answered with one line on stderr
and exit code 2; a failure inside a run with exit code 1 and its message, never a traceback.

Start-up: a command's module (and what it imports: the cluster simulator for `capacity`, the
routers for `route`, ...) is imported when its parser is built. `main` builds the parser of the
command it is given alone (argparse consults no other subparser once the command is named, so
its parsing, help and errors are the same as the full parser's); the full parser
(`build_parser`) is built when the first argument names no command (`--help`, `--version`, a
typo). `simulate` and `compare` thus load the simulator, the metrics and the trace loaders, and
none of the other commands' modules (tests/cli/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

from contbatch import __version__
from contbatch.collector import collector_paused

# command -> (its module; the function adding its parser; the function running it), in the order
# of the command list; one parser function may add several commands
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "simulate": (__name__, "add_simulation_parsers", "run_simulation_command"),
    "compare": (__name__, "add_simulation_parsers", "run_simulation_command"),
    "capacity": ("contbatch.cli.capacity_cmd", "add_capacity_parser", "run_capacity_command"),
    "generate": ("contbatch.cli.engine_cmd", "add_engine_parsers", "run_generate_command"),
    "run": ("contbatch.cli.engine_cmd", "add_engine_parsers", "run_run_command"),
    "calibrate": ("contbatch.cli.calibrate_cmd", "add_calibrate_parsers", "run_calibrate_command"),
    "validate": ("contbatch.cli.calibrate_cmd", "add_calibrate_parsers", "run_validate_command"),
    "sweep": ("contbatch.cli.sweep_cmd", "add_sweep_parser", "run_sweep_command"),
    "serve": ("contbatch.cli.serve_cmd", "add_serve_parser", "run_serve_command"),
    "route": ("contbatch.cli.route_cmd", "add_route_parser", "run_route_command"),
    "bench": ("contbatch.cli.bench_cmd", "add_bench_parser", "run_bench_command"),
    "observe": ("contbatch.cli.observe_cmd", "add_observe_parsers", "run_observe_command"),
    "fit": ("contbatch.cli.observe_cmd", "add_observe_parsers", "run_fit_command"),
}


def _function(module: str, name: str) -> Callable[..., Any]:
    """`name` of `module` (imported now if it was not)."""
    return cast(Callable[..., Any], getattr(importlib.import_module(module), name))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's, or with `command` that command's alone (and
    those its module adds with it)."""
    parser = argparse.ArgumentParser(
        prog="contbatch",
        description="Continuous batching, measured: simulate LLM serving schedulers on a trace.",
    )
    parser.add_argument("--version", action="version", version=f"contbatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    added: set[tuple[str, str]] = set()
    for name in _COMMANDS if command is None else (command,):
        module, add, _ = _COMMANDS[name]
        if (module, add) not in added:
            added.add((module, add))
            _function(module, add)(commands)
    return parser


def add_simulation_parsers(commands: Any) -> None:
    """The parsers of `simulate` and `compare`."""
    from contbatch.cli.options import add_run_flags, add_vary_flags

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


def _scheduler_names(args: argparse.Namespace) -> tuple[str, ...]:
    if args.command == "simulate":
        return (args.scheduler,)
    if args.schedulers is None:
        varied = args.vary or args.admission or args.policy
        return ("continuous",) if varied else ("static", "continuous")
    return tuple(n.strip() for n in args.schedulers.split(",") if n.strip())


def run_simulation_command(args: argparse.Namespace) -> int:
    """`simulate` and `compare`: resolve the flags, run every variant, print the report."""
    from contbatch.cli.options import UsageError, resolve
    from contbatch.cli.report import run_all, to_document, to_json, to_text, write_out_dir
    from contbatch.sim.loop import SimulationStalled

    with collector_paused():
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
        text = to_json(document) if opts.as_json else to_text(opts, outcomes)
    write_out_dir(opts, outcomes, document)
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in _COMMANDS else None
    with collector_paused():  # (building the parser imports the command's modules: no garbage to find)
        args = build_parser(command).parse_args(argv)
    try:
        module, _, run = _COMMANDS[args.command]
        code: int = _function(module, run)(args)
        sys.stdout.flush()  # (here, so that a reader gone away is caught below, not at exit)
        return code
    except BrokenPipeError:  # the reader left (`contbatch ... | head`): not an error, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail)
        return 0


if __name__ == "__main__":
    sys.exit(main())
