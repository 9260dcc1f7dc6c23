"""`contbatch observe`, `contbatch fit` and `contbatch validate --observed`: the simulator fitted to
any OpenAI-compatible server from the outside (`contbatch.observe`).

- `observe --url URL --out obs.jsonl [--budget-s 300]`: sends the probe plan (warm-up, prefill
  grid, decode concurrency sweep, open-loop runs at ``--open-rates`` fractions of the capacity)
  and records every request's send time, chunk arrivals and usage, one line per run;
- `fit --observed obs.jsonl --server NAME [--set KEY=VALUE] --out profile.json`: simulates the
  observed runs under the server's scheduler config and fits the affine cost whose per-chunk
  timelines match; prints the terms and the residuals per run, writes a profile for
  ``--cost profile:profile.json``;
- `validate --observed held-out.jsonl [--observed ...] --profile profile.json`: predicts the
  (``open``) runs of other observations and prints each metric's error (``--plot DIR``: CDFs).

Bad input (flags, an unreachable server, an unreadable file) exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from contbatch.cli.options import UsageError, scheduler_config
from contbatch.sim.cost import AffineCost

_DEFAULT_KINDS = "prefill,decode,open"


def _ints(text: str, flag: str, count: int | None = None) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or (count is not None and len(values) != count):
        raise UsageError(f"{flag}: expected {count or 'one or more'} comma-separated integers, got {text!r}")
    return values


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def add_observe_parsers(commands: Any) -> None:
    observe = commands.add_parser(
        "observe",
        help="record an OpenAI-compatible server under a probe plan (for contbatch fit)",
        description="Send a probe plan (prefill grid, decode concurrency sweep, open-loop runs) to any "
        "OpenAI-compatible server within a time budget; record send times, chunk arrivals and usage.",
    )
    observe.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    observe.add_argument("--model", help="the model to ask for (default: the server's first)")
    observe.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    observe.add_argument("--out", required=True, type=Path, help="the observation file to write (JSON lines)")
    observe.add_argument("--budget-s", type=float, default=300.0, help="stop sending after this long (300)")
    observe.add_argument("--phases", default="warmup,prefill,decode,open", help="which phases to run")
    observe.add_argument("--prompt-lengths", default="16,64,256,512,1024", help="prefill grid (tokens)")
    observe.add_argument("--prefill-repeats", type=int, default=2)
    observe.add_argument("--concurrency", default="1,2,4,8,16", help="decode sweep: requests at once")
    observe.add_argument("--decode-prompt", type=int, default=32)
    observe.add_argument("--decode-output", type=int, default=128)
    observe.add_argument("--long-prompt", type=int, default=512, help="the sweep again at this prompt (0: not)")
    observe.add_argument("--long-concurrency", default="1,4,16")
    observe.add_argument("--open-rates", default="0.4,0.8", help="open runs: fractions of the capacity")
    observe.add_argument("--open-requests", type=int, default=40)
    observe.add_argument("--open-prompt", default="32,512", help="LOW,HIGH prompt tokens of open runs")
    observe.add_argument("--open-output", default="16,128", help="LOW,HIGH output tokens of open runs")
    observe.add_argument("--capacity", type=float, help="requests/s the open rates are fractions of "
                         "(default: estimated from the prefill and decode runs)")  # fmt: skip
    observe.add_argument("--extensions", choices=("auto", "on", "off"), default="auto",
                         help="vLLM's ignore_eos, continuous_usage_stats (auto: if the server takes them)")  # fmt: skip
    observe.add_argument("--timeout", type=float, default=120.0, help="per request, seconds between reads")
    observe.add_argument("--seed", type=int, default=0,
                         help="arrivals, lengths and prompt texts (0); against a server with prefix caching give "
                         "each observation its own seed, or its prompts hit what the same seed cached")  # fmt: skip
    observe.add_argument("--no-speed-probe", dest="speed_probe", action="store_false",
                         help="no fixed one-request probe around each run (machine drift)")  # fmt: skip
    observe.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_fit_parser(commands)


def _add_fit_parser(commands: Any) -> None:
    from contbatch.observe.servers import SERVER_PRESETS

    fit = commands.add_parser(
        "fit",
        help="fit the simulator's cost to an observed server (writes a profile)",
        description="Simulate the observed runs under the server's scheduler config and fit the affine step cost "
        "whose per-chunk timelines match the observed ones; write a profile for --cost profile:PATH.",
    )
    fit.add_argument("--observed", required=True, action="append", type=Path, help="observation file(s)")
    fit.add_argument("--server", required=True, help=f"scheduler preset: {', '.join(SERVER_PRESETS)}")
    fit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="scheduler config field over the server preset, e.g. kv.num_blocks=2048")  # fmt: skip
    fit.add_argument("--scheduler", default="continuous", help="continuous (default) or static")
    fit.add_argument("--runs", default=_DEFAULT_KINDS, help=f"run kinds to fit on ({_DEFAULT_KINDS})")
    fit.add_argument("--out", required=True, type=Path, help="the profile JSON file to write")
    fit.add_argument("--method", choices=("steps", "chunks"), default="steps",
                     help="step terms from the server's steps read from the streamed chunks, then the delivery "
                     "(default; chunks below 50 timed steps), or all terms by matching every chunk time")  # fmt: skip
    fit.add_argument("--json", action="store_true", help="print the fit as JSON")


def add_observed_flags(validate: argparse.ArgumentParser) -> None:
    """`validate --observed FILE [--runs KINDS]`: predict observed runs instead of the engine."""
    validate.add_argument("--observed", action="append", type=Path, metavar="FILE",
                          help="validate against these observation files (contbatch observe) instead of the engine; "
                          "runs of one name across files are replays")  # fmt: skip
    validate.add_argument("--runs", default="open", help="with --observed: run kinds to predict (open)")


# -- observe ------------------------------------------------------------------------------------
def _plan(args: argparse.Namespace) -> Any:
    from contbatch.observe.plan import PlanConfig

    try:
        return PlanConfig(
            phases=tuple(p.strip() for p in args.phases.split(",") if p.strip()),
            prompt_lengths=_ints(args.prompt_lengths, "--prompt-lengths"),
            prefill_repeats=args.prefill_repeats,
            concurrency=_ints(args.concurrency, "--concurrency"),
            decode_prompt=args.decode_prompt, decode_output=args.decode_output, long_prompt=args.long_prompt,
            long_concurrency=_ints(args.long_concurrency, "--long-concurrency"),
            open_rates=_floats(args.open_rates, "--open-rates"), open_requests=args.open_requests,
            open_prompt=_ints(args.open_prompt, "--open-prompt", 2),  # type: ignore[arg-type]
            open_output=_ints(args.open_output, "--open-output", 2),  # type: ignore[arg-type]
            seed=args.seed,
            speed_probe=args.speed_probe,
        )  # fmt: skip
    except ValueError as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"plan: {exc}") from None


def _check_observe(args: argparse.Namespace) -> None:
    if not args.budget_s > 0 or not args.timeout > 0:
        raise UsageError(f"--budget-s and --timeout must be > 0, got {args.budget_s} and {args.timeout}")
    if args.capacity is not None and not args.capacity > 0:
        raise UsageError(f"--capacity must be > 0 requests/s, got {args.capacity}")
    if not args.url.startswith(("http://", "https://")):
        raise UsageError(f"--url {args.url!r}: expected http://HOST:PORT")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out {args.out}: no such directory {args.out.parent}")


def run_observe_command(args: argparse.Namespace) -> int:
    from contbatch.observe.probe import ObserveConfig, ObserveError, observe, resolve_target

    try:
        _check_observe(args)
        plan = _plan(args)
        target = resolve_target(args.url, args.model, chat=args.chat, extensions=args.extensions)
    except (UsageError, ObserveError) as exc:
        print(f"contbatch observe: error: {exc}", file=sys.stderr)
        return 2
    config = ObserveConfig(target, plan, args.budget_s, args.capacity, args.timeout)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    progress(f"observing {target.root} (model {target.model}; extensions: {', '.join(target.extensions) or 'none'})")
    started = time.monotonic()
    try:
        observation = observe(config, args.out, progress)
    except ObserveError as exc:
        print(f"contbatch observe: error: {exc}", file=sys.stderr)
        return 2
    done = sum(len(run.completed) for run in observation.runs)
    print(f"observation: {args.out} ({len(observation.runs)} runs, {done} completed requests, "
          f"{time.monotonic() - started:.0f} s)")  # fmt: skip
    return 0


# -- fit ----------------------------------------------------------------------------------------
def _kinds(text: str, flag: str) -> tuple[str, ...]:
    from contbatch.observe.record import RUN_KINDS

    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in RUN_KINDS]
    if unknown or not kinds:
        raise UsageError(f"{flag}: unknown run kind {', '.join(unknown) or '(none)'}; known: {', '.join(RUN_KINDS)}")
    return kinds


def server_config(server: str, overrides: list[str]) -> Any:
    """The scheduler config of a server preset plus ``--set`` overrides; UsageError if bad."""
    from contbatch.observe.servers import server_overrides

    try:
        base, preset = server_overrides(server)
    except ValueError as exc:
        raise UsageError(f"--server: {exc}") from None
    return scheduler_config(base, AffineCost(), [*preset.overrides, *overrides])


def _load(paths: list[Path]) -> list[Any]:
    from contbatch.observe.record import ObservationError, load_observation

    try:
        return [load_observation(path) for path in paths]
    except ObservationError as exc:
        raise UsageError(f"--observed: {exc}") from None


def _unique(files: list[Any]) -> list[Any]:
    """The runs of several files, a name seen in an earlier file suffixed ``@N`` (N: the file's
    1-based position), so that a run's name keeps naming one run."""
    seen: set[str] = set()
    out = []
    for number, runs in enumerate(files, 1):
        for run in runs:
            out.append(run if run.name not in seen else dataclasses.replace(run, name=f"{run.name}@{number}"))
            seen.add(out[-1].name)
    return out


def _scheduler(name: str) -> str:
    from contbatch.core import SCHEDULERS

    if name not in SCHEDULERS:
        raise UsageError(f"--scheduler: unknown {name!r}; known: {', '.join(SCHEDULERS)}")
    return name


def run_fit_command(args: argparse.Namespace) -> int:
    from contbatch.observe.fit import FitError, fit
    from contbatch.observe.profile import profile_document, write_profile

    try:
        config = server_config(args.server, args.overrides)
        kinds = _kinds(args.runs, "--runs")
        scheduler = _scheduler(args.scheduler)
        observations = _load(args.observed)
        if not args.out.parent.is_dir():
            raise UsageError(f"--out {args.out}: no such directory {args.out.parent}")
    except UsageError as exc:
        print(f"contbatch fit: error: {exc}", file=sys.stderr)
        return 2
    runs = _unique([obs.select(kinds) for obs in observations])
    try:
        result = fit(runs, config, scheduler=scheduler, method=args.method)
    except FitError as exc:
        print(f"contbatch fit: error: {exc}", file=sys.stderr)
        return 2
    document = profile_document(
        result, observation=", ".join(str(p) for p in args.observed), target=observations[0].header.get("target", {}),
        server=args.server, overrides=args.overrides, scheduler=scheduler, config=dataclasses.asdict(config),
        runs=[run.name for run in runs],
    )  # fmt: skip
    write_profile(document, args.out)
    if args.json:
        print(json.dumps({"profile": str(args.out), **document["cost"]["affine"], **document["observed"]}, indent=1))
        return 0
    print(_fit_text(result, args))
    return 0


def _method_text(result: Any) -> str:
    if result.method == "steps":
        return f"fit by steps: {result.num_timed_steps} steps timed from the chunks, then the delivery"
    return f"fit by chunks: {len(result.iterations)} simulations"


def _fit_text(result: Any, args: argparse.Namespace) -> str:
    t = result.terms
    lines = [
        f"profile: {args.out} (server {args.server}{''.join(' --set ' + o for o in args.overrides)}; "
        f"{result.num_requests} requests; {_method_text(result)})",
        f"step ms = {t.base_ms:.4g} + {t.prefill_ms:.4g} x prefill + {t.decode_ms:.4g} x decode "
        f"+ {t.context_ms:.4g} x context tokens + {t.prefill_pair_ms:.4g} x prefill token pairs "
        f"+ {t.batch_pair_ms:.4g} x batch token pairs; delivery {t.delivery_ms:.3g} ms per chunk",
        f"objective per request: {result.objective:.4g} (relative TTFT error^2 + mean relative gap error^2)",
        "",
        f"{'run':<22}{'reqs':>5}{'TTFT obs':>10}{'pred':>9}{'|err|':>7}{'gap obs':>9}{'pred':>8}{'|err|':>7}",
    ]
    for r in result.residuals:
        tpot = (f"{r.tpot_observed_ms:>9.2f}{r.tpot_predicted_ms:>8.2f}{100 * (r.gap_mean_abs_rel or 0):>6.1f}%"
                if r.tpot_observed_ms is not None else "")  # fmt: skip
        lines.append(f"{r.run:<22}{r.num_requests:>5}{r.ttft_observed_ms:>10.2f}{r.ttft_predicted_ms:>9.2f}"
                     f"{100 * r.ttft_mean_abs_rel:>6.1f}%{tpot}")  # fmt: skip
    lines.append(
        "ms; |err|: mean |relative error| per request (TTFT) and per chunk gap (against the request's mean gap)"
    )
    return "\n".join(lines)


# -- validate --observed ------------------------------------------------------------------------
def run_observed_validate(args: argparse.Namespace) -> int:
    from contbatch.sim.cost import CostSpecError

    try:
        kinds = _kinds(args.runs, "--runs")
        from contbatch.observe.profile import read_observed

        try:
            cost, observed = read_observed(args.profile)
        except (CostSpecError, ValueError) as exc:
            raise UsageError(f"--profile: {exc}") from None
        config = server_config(observed["server"], list(observed["overrides"]))
        observations = _load(args.observed)
    except UsageError as exc:
        print(f"contbatch validate: error: {exc}", file=sys.stderr)
        return 2
    from contbatch.observe.validate import format_runs, group_replays, validate_runs

    groups = group_replays([obs.runs for obs in observations], kinds)
    if not groups:
        print(f"contbatch validate: error: --observed: no run of kind {', '.join(kinds)} in the files", file=sys.stderr)
        return 2
    delivery = float(observed["delivery_ms"])
    source = args.speed_source if args.speed_probe else "calibration"
    reference = observed.get("speed_reference_ms")
    scheduler = observed["scheduler"]
    results = [
        validate_runs(
            runs, config, cost, delivery_ms=delivery, scheduler=scheduler, speed_source=source, reference_ms=reference
        )
        for runs in groups.values()
    ]
    plots = _plots(results, args.plot) if args.plot is not None else []
    if args.json:
        print(json.dumps({"profile": str(args.profile), "runs": [r.as_dict() for r in results],
                          "plots": [str(p) for p in plots]}, indent=1))  # fmt: skip
        return 0
    print(f"profile: {args.profile} (server {observed['server']}, delivery {delivery:.3g} ms); "
          f"observations: {', '.join(str(p) for p in args.observed)}\n")  # fmt: skip
    print(format_runs(results))
    speeds = "; ".join(f"{r.name} " + ", ".join(f"x{d:.3f}/x{p:.3f}" for d, p in r.speeds) for r in results)
    print(f"machine speed per replay ({source}; decode-only steps / steps with prefill, against the fit's): {speeds}")
    for path in plots:
        print(f"plot: {path}")
    return 0


def _plots(results: list[Any], out_dir: Path) -> list[Path]:
    from contbatch.plots.cdf import plot_latency_cdfs

    paths: list[Path] = []
    for r in results:
        runs = {"server (observed)": list(r.measured), "simulator (predicted)": list(r.predicted)}
        paths += plot_latency_cdfs(runs, out_dir, time_unit="s", stem=f"observed-{r.name}")
    return paths
