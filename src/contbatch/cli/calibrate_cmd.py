"""`contbatch calibrate` and `contbatch validate`: the simulator's cost model measured on the real
engine, and the simulator's prediction error against the engine on a trace.

- `calibrate --model DIR|demo --out profile.json`: times engine steps over a grid and in a real
  run, fits an affine and a table model, keeps the one with the lower held-out error, and writes
  the profile (`contbatch.calibrate.profile_doc`). `--cost profile:profile.json` then prices
  simulator steps with it.
- `validate --model DIR|demo --profile profile.json --trace T`: runs T on the engine in real
  time, then in the simulator with the profile and the engine's scheduler config, and prints
  predicted against measured per metric with the relative error (`--json`, `--plot DIR`). Each
  replay is predicted at the machine speed during it (`--speed-source`: `step-kinds`, the
  default, from its own engine steps, decode-only steps and steps with prefill apart; `steps`,
  one speed from all of them; `probe`, the profile's probe timed around it; `calibration`).
- `validate --observed obs.jsonl --profile profile.json`: the same comparison against runs of a
  server observed from the outside (`contbatch observe`, `contbatch fit`; `contbatch.cli.observe_cmd`).

Torch threads: `calibrate --threads N` (default: torch's current setting) is recorded in the
profile; `validate` uses the profile's unless told otherwise. `calibrate --clock thread-cpu` times
the grid by the thread's CPU time (with `--threads 1` on the CPU: a shared machine's load does not
inflate it); the engine runs, whose cycle times the profile's loop terms fit, stay on the wall
clock. Bad input (flags, profile file, trace) exits 2 with one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from contbatch.cli.engine_cmd import add_engine_flags, engine_config
from contbatch.cli.observe_cmd import add_observed_flags, run_observed_validate
from contbatch.cli.options import UsageError
from contbatch.sim.cost import CostSpecError
from contbatch.traces import TraceError, load_trace

DEMO = "demo"


def _bad_input(*more: type[Exception]) -> tuple[type[Exception], ...]:
    """What a run answers with exit code 2 (`more` and an unreadable model, a grid the cache
    cannot hold), imported here: torch loads only for the commands that need it."""
    from contbatch.calibrate.grid import CalibrationError
    from contbatch.engine.errors import CheckpointError, UnsupportedModel

    return (*more, OSError, CheckpointError, UnsupportedModel, CalibrationError)


def _shared_flags(parser: argparse.ArgumentParser) -> None:
    help_text = "a local Hugging Face checkpoint directory, or demo (default)"
    add_engine_flags(parser, model_default=DEMO, model_help=help_text)


def add_calibrate_parsers(commands: Any) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="fit the simulator's cost model to the real engine",
        description="Time real engine steps over a grid and in a real run, fit affine and table cost models, "
        "keep the one with the lower held-out error, and write a profile for --cost profile:PATH.",
    )
    calibrate.add_argument("--out", required=True, type=Path, help="the profile JSON file to write")
    calibrate.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's current setting)")
    calibrate.add_argument("--prefill", help="grid prefill tokens, e.g. 0,64,256,512,1024 (must start at 0)")
    calibrate.add_argument("--decodes", help="grid decode counts (batch buckets), e.g. 0,1,2,4,8,16,32,64,128")
    calibrate.add_argument("--context", help="grid context per decode, e.g. 32,128,384,768")
    calibrate.add_argument("--repeats", type=int, default=5, help="timed runs per grid point (default 5)")
    calibrate.add_argument("--warmup", type=int, default=1, help="untimed runs per grid point (default 1)")
    calibrate.add_argument("--clock", default="wall",
                           help="what times a grid run: wall, elapsed time (default), or thread-cpu, "
                           "the thread's CPU time, which other load does not inflate (needs --threads 1)")  # fmt: skip
    calibrate.add_argument("--run-requests", type=int, default=160, help="requests of each calibration engine run")
    calibrate.add_argument("--runs", type=int, default=3,
                           help="calibration engine runs, the speed probe timed around each (default 3)")  # fmt: skip
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--quiet", action="store_true", help="no progress bar")
    _shared_flags(calibrate)
    validate = commands.add_parser(
        "validate",
        help="compare the calibrated simulator with the real engine on a trace",
        description="Run a trace on the real engine (real time), then in the simulator with a calibrated profile "
        "and the same scheduler config; print predicted against measured per metric with the relative error.",
    )
    validate.add_argument("--profile", required=True, type=Path, help="a profile written by contbatch calibrate")
    validate.add_argument("--trace", help="a built-in trace or a .jsonl/.csv file (seconds); needed without --observed")
    validate.add_argument("--scheduler", default="continuous", help="continuous (default) or static")
    validate.add_argument("--threads", type=int, help="torch threads (default: the profile's)")
    validate.add_argument("--replays", type=int, default=1,
                          help="engine replays of the trace; a row is the replay of median error (1)")  # fmt: skip
    validate.add_argument("--speed-source", choices=("step-kinds", "steps", "probe", "calibration"),
                          default="step-kinds",
                          help="each replay's machine speed: from its own engine steps (--observed: its steps "
                          "read from the streamed chunks), decode-only and prefill apart (default) or together, "
                          "from the speed probe timed around it, or the calibration run's "
                          "(--observed: the fit's)")  # fmt: skip
    validate.add_argument("--no-speed-probe", dest="speed_probe", action="store_false",
                          help="predict at the reference speed (the calibration run's; --observed: the fit's), "
                          "as --speed-source calibration")  # fmt: skip
    validate.add_argument("--json", action="store_true", help="print the comparison as JSON")
    validate.add_argument("--plot", type=Path, metavar="DIR", help="write the measured and predicted CDFs here")
    add_observed_flags(validate)
    _shared_flags(validate)


def _engine_config(args: argparse.Namespace, kind: str = "continuous") -> Any:
    if args.model != DEMO and not Path(args.model).is_dir():
        raise UsageError(f"--model {args.model}: not a directory (give a checkpoint directory or demo)")
    return engine_config(args, kind, model=None if args.model == DEMO else args.model)


def _axis(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _threads(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise UsageError(f"--threads must be >= 1, got {value}")
    return value


def _calibration_config(args: argparse.Namespace) -> Any:
    from contbatch.calibrate import CalibrationConfig, GridSpec

    default = GridSpec()
    grid = GridSpec(
        prefill=_axis(args.prefill, "--prefill") or default.prefill,
        decode=_axis(args.decodes, "--decodes") or default.decode,
        context=_axis(args.context, "--context") or default.context,
        warmup=args.warmup,
        repeats=args.repeats,
        clock=args.clock,
    )
    if args.run_requests < 4 or args.runs < 1:
        raise UsageError(f"--run-requests must be >= 4 and --runs >= 1, got {args.run_requests} and {args.runs}")
    return CalibrationConfig(engine=_engine_config(args), grid=grid, threads=_threads(args.threads),
                             loop_requests=args.run_requests, loop_runs=args.runs, seed=args.seed)  # fmt: skip


class _Bars:
    """One tqdm bar per calibration stage; a stage's bar closes when the next one starts."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.bar: Any = None

    def stage(self, description: str, total: int) -> Any:
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

        self.close()
        self.bar = tqdm(total=total, desc=description, unit="run", disable=self.quiet, file=sys.stderr)
        return self.bar.update

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_calibrate_command(args: argparse.Namespace) -> int:
    from contbatch.calibrate import calibrate
    from contbatch.calibrate.profile_doc import write_profile

    try:
        config = _calibration_config(args)
        if not args.out.parent.is_dir():
            raise UsageError(f"--out {args.out}: no such directory {args.out.parent}")
    except _bad_input(UsageError) as exc:
        print(f"contbatch calibrate: error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    bars = _Bars(args.quiet)
    try:
        result = calibrate(config, bars.stage)
    except _bad_input() as exc:
        print(f"contbatch calibrate: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a fit the measurements cannot support
        print(f"contbatch calibrate: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bars.close()
    write_profile(result.document, args.out)
    doc = result.document
    engine = doc["engine"]
    print(f"profile: {args.out} ({time.monotonic() - started:.0f} s; {engine['threads']} threads, "
          f"{engine['dtype']} on {engine['device']}, torch {engine['torch_version']})")  # fmt: skip
    for name, fit in doc["fits"].items():
        mark = "  <- chosen" if name == doc["chosen"] else ""
        grid, steps = fit["heldout_grid"]["mean_abs_rel_error"], fit["heldout_engine_steps"]["mean_abs_rel_error"]
        print(f"{name:>6}: held-out error (mean |rel|) on grid points {100 * grid:.1f}%, "
              f"on engine steps {100 * steps:.1f}%{mark}")  # fmt: skip
    cost = doc["cost"]
    print("affine (ms): " + ", ".join(f"{k} {v:.4g}" for k, v in cost["affine"].items()))
    print(f"engine loop: runner x {cost['loop_scale']:.3g}, + {cost['loop_base_ms']:.3g} ms per step "
          f"+ {cost['loop_request_ms']:.3g} ms per request")  # fmt: skip
    bins = ", ".join(f"{low}+ x {scale:.3g}" for low, scale in cost["decode_loop_scales"])
    print(f"runner in the loop by decodes per step: {bins or 'one scale'}")
    speeds = ", ".join(f"x{speed:.3f}" for speed in doc["speed_probe"]["run_speeds"])
    print(f"machine speed per engine run (probe, against their mean): {speeds}")
    return 0


def _load_profile(path: Path, threads: int | None) -> tuple[Any, dict[str, Any]]:
    from contbatch.sim.costs.profile import load_profile

    try:
        cost = load_profile(path)
    except CostSpecError as exc:
        raise UsageError(f"--profile: {exc}") from None
    document = json.loads(path.read_text(encoding="utf-8"))
    engine = document.get("engine") if isinstance(document.get("engine"), dict) else {}
    recorded = engine.get("threads")
    chosen = _threads(threads) or (recorded if isinstance(recorded, int) and recorded >= 1 else None)
    return cost, {**document, "threads_used": chosen}


def run_validate_command(args: argparse.Namespace) -> int:
    if args.observed:
        return run_observed_validate(args)
    try:
        if args.trace is None:
            raise UsageError("--trace is required (or --observed FILE to validate against an observed server)")
        cost, document = _load_profile(args.profile, args.threads)
        trace = load_trace(args.trace, time_unit="s")
        config = _engine_config(args, args.scheduler)
        if args.scheduler not in ("continuous", "static"):
            raise UsageError(f"--scheduler: unknown {args.scheduler!r}; known: continuous, static")
        if args.replays < 1:
            raise UsageError(f"--replays must be >= 1, got {args.replays}")
    except (UsageError, TraceError) as exc:
        print(f"contbatch validate: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from contbatch.calibrate import format_validation, validate
    from contbatch.calibrate.probe import reference_probe

    if document["threads_used"] is not None:
        torch.set_num_threads(document["threads_used"])
    try:
        source = args.speed_source if args.speed_probe else "calibration"
        probe = reference_probe(document) if source == "probe" else None
        result = validate(config, cost, trace, replays=args.replays, reference_probe=probe, speed_source=source)
    except _bad_input(ValueError) as exc:
        print(f"contbatch validate: error: {exc}", file=sys.stderr)
        return 2
    plots = _plot(result, args.plot, trace.name) if args.plot is not None else []
    if args.json:
        print(json.dumps({**result.as_dict(), "profile": str(args.profile), "threads": torch.get_num_threads(),
                          "plots": [str(p) for p in plots]}, indent=1))  # fmt: skip
        return 0
    model = document.get("model", {}).get("name", "?") if isinstance(document.get("model"), dict) else "?"
    print(f"trace: {trace.name} ({len(trace)} requests) - {trace.source}")
    print(f"profile: {args.profile} (model {model}, {document['cost']['model']} fit); "
          f"torch threads {torch.get_num_threads()}\n")  # fmt: skip
    print(format_validation(result))
    for path in plots:
        print(f"plot: {path}")
    return 0


def _plot(result: Any, out_dir: Path, name: str) -> list[Path]:
    from contbatch.plots.cdf import plot_latency_cdfs

    runs = {"engine (measured)": result.measured, "simulator (predicted)": result.predicted}
    return list(plot_latency_cdfs(runs, out_dir, time_unit="s", stem=f"validation-{name}"))
