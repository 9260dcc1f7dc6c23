"""Command-line flags -> configs, in one place.

`RunOptions` is everything a `simulate` or `compare` run needs, resolved and validated: the
trace, the cost model, the scheduler config (a preset plus `--set` overrides), the scheduler
names, the SLO and which per-group results to add. Any bad value raises `UsageError` with one
line that names it; the CLI turns that into exit code 2.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contbatch.core import SCHEDULERS, ConfigError, SchedulerConfig, seed_config
from contbatch.core.config import PRESETS, parse_value
from contbatch.metrics import SLO
from contbatch.sim.cost import CostModel, CostSpecError, UnitCost, cost_help, parse_cost
from contbatch.traces import Trace, TraceError, builtin_trace_names, load_trace


class UsageError(ValueError):
    """A flag's value is invalid; the message is one line naming it."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One column of a comparison: a scheduler and its config."""

    label: str
    scheduler: str
    config: SchedulerConfig


@dataclass(frozen=True, slots=True)
class RunOptions:
    trace: Trace
    cost_spec: str
    cost: CostModel
    preset: str
    config: SchedulerConfig  # the shared config, before any --vary
    preset_config: SchedulerConfig  # the preset it started from (to show what --set changed)
    variants: tuple[Variant, ...]
    slo: SLO | None
    acceptance_rate: float
    as_json: bool
    out_dir: Path | None
    per_request: bool  # print / embed per-request TTFT, TPOT and completion
    group_by: tuple[str, ...] = ()  # per-group results to add: "tenant" and/or "priority"
    streaming: bool = False  # keep summaries only, not every timeline (very large traces)
    plot_dir: Path | None = None  # --plot: write the run's figures (PNG and SVG) here


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(builtin_trace_names())
    parser.add_argument("--trace", default="seed", help=f"a built-in trace ({names}) or a .jsonl/.csv file")
    cost_kinds = cost_help().replace("%", "%%")  # argparse formats help with %
    parser.add_argument("--cost", default="unit:8", help=f"cost model (default %(default)s), one of: {cost_kinds}")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="scheduling semantics; default: seed for unit costs (token budget = C), engine otherwise",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scheduler config field, e.g. max_num_batched_tokens=4096, max_num_seqs=none, kv.num_blocks=2048, "
        "kv=none (no memory limit), batch_buckets=1/2/4/8",
    )
    parser.add_argument(
        "--spec-acceptance",
        type=float,
        default=1.0,
        metavar="P",
        help="speculative decoding: probability that each draft token is accepted (default 1.0)",
    )
    parser.add_argument("--slo", help="latency objectives for goodput, e.g. ttft=2,tpot=0.1,e2e=30 (clock unit)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="keep per-request summaries only, not every token timestamp (for traces of millions of requests)",
    )
    parser.add_argument("--out", type=Path, help="also write results.json and per-request JSONL/CSV here")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="DIR",
        help="write figures (PNG and SVG) here: the request timeline (traces of at most 64 requests), "
        "TTFT/TPOT/E2E CDFs, and KV usage and batch size over time",
    )
    parser.add_argument(
        "--per-request",
        choices=("auto", "on", "off"),
        default="auto",
        help="per-request TTFT/TPOT/completion in the output (auto: on for traces of at most 64 requests)",
    )
    parser.add_argument(
        "--by",
        choices=("auto", "tenant", "priority", "none"),
        default="auto",
        help="per-group results after the main table and in JSON (auto: per tenant when the trace has more than "
        "one tenant, per priority when it has more than one priority)",
    )


def add_vary_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vary",
        metavar="KEY=V1,V2,...",
        help="one column per value of a scheduler config field, e.g. kv.preemption=recompute,swap",
    )
    parser.add_argument(
        "--admission", metavar="MODES", help="shorthand for --vary kv.admission=MODES (reserve,optimistic,estimate)"
    )
    parser.add_argument("--policy", metavar="NAMES", help="shorthand for --vary queue_order=NAMES, e.g. fcfs,fair")


def resolve(args: argparse.Namespace, schedulers: tuple[str, ...]) -> RunOptions:
    cost = cost_model(args.cost)
    preset = args.preset or ("seed" if isinstance(cost, UnitCost) else "engine")
    trace = _trace(args.trace, cost.time_unit)
    streaming = bool(getattr(args, "streaming", False))
    if streaming and (getattr(args, "plot", None) is not None or args.by in ("tenant", "priority")):
        raise UsageError("--streaming keeps no timelines: it cannot be combined with --plot or --by")
    per_request = {"on": True, "off": False}.get(args.per_request, len(trace) <= 64) and not streaming
    config = scheduler_config(preset, cost, args.overrides)
    if not 0.0 <= args.spec_acceptance <= 1.0:
        raise UsageError(f"--spec-acceptance must be in [0, 1], got {args.spec_acceptance}")
    return RunOptions(
        trace=trace,
        cost_spec=args.cost,
        cost=cost,
        preset=preset,
        config=config,
        preset_config=scheduler_config(preset, cost, []),
        variants=_variants(_schedulers(schedulers), config, _vary_spec(args)),
        slo=_slo(args.slo) if args.slo else None,
        acceptance_rate=args.spec_acceptance,
        as_json=args.json,
        out_dir=args.out,
        per_request=per_request,
        group_by=() if streaming else _group_by(args.by, trace),
        streaming=streaming,
        plot_dir=getattr(args, "plot", None),
    )


def cost_model(spec: str) -> CostModel:
    try:
        return parse_cost(spec)
    except CostSpecError as exc:
        raise UsageError(f"--cost: {exc}") from None


def _trace(spec: str, clock_unit: str) -> Trace:
    try:
        trace = load_trace(spec, time_unit=None if spec in builtin_trace_names() else clock_unit)
    except TraceError as exc:
        raise UsageError(f"--trace: {exc}") from None
    if trace.time_unit != clock_unit:
        raise UsageError(
            f"--trace {spec} is timed in {trace.time_unit} units but the cost model's clock is in {clock_unit} units; "
            f"use {'--cost unit:C' if trace.time_unit == 'tick' else '--cost affine'}"
        )
    return trace


def scheduler_config(preset: str, cost: CostModel, overrides: list[str]) -> SchedulerConfig:
    base = seed_config(cost.capacity) if preset == "seed" and isinstance(cost, UnitCost) else PRESETS[preset]
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        _put(values, key, parse_value(raw.strip()))
    return _apply(base, values, "--set")


def _put(values: dict[str, Any], key: str, value: object) -> None:
    """`kv.num_blocks=8` goes to values["kv"]["num_blocks"]."""
    parts = key.strip().replace("-", "_").split(".")
    if len(parts) > 2 or not all(parts):
        raise UsageError(f"bad config key {key!r}: expected FIELD or kv.FIELD")
    if len(parts) == 2:
        nested = values.setdefault(parts[0], {})
        if not isinstance(nested, dict):
            raise UsageError(f"config key {key!r} conflicts with {parts[0]}={nested!r}")
        nested[parts[1]] = value
    else:
        values[parts[0]] = value


def _apply(base: SchedulerConfig, values: dict[str, Any], flag: str) -> SchedulerConfig:
    try:
        return SchedulerConfig.from_dict(values, base=base)
    except ConfigError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _group_by(choice: str, trace: Trace) -> tuple[str, ...]:
    """The group keys to report: as asked, or (auto) each key the trace has more than one value of."""
    if choice == "none":
        return ()
    if choice != "auto":
        return (choice,)
    tenants = {r.tenant for r in trace.requests}
    priorities = {r.priority for r in trace.requests}
    return tuple(key for key, found in (("tenant", tenants), ("priority", priorities)) if len(found) > 1)


# Shorthands for --vary: flag attribute -> the config key it varies.
_VARY_SHORTHANDS: dict[str, str] = {"admission": "kv.admission", "policy": "queue_order"}


def _vary_spec(args: argparse.Namespace) -> tuple[str, list[str]] | None:
    given = [name for name in (*_VARY_SHORTHANDS, "vary") if getattr(args, name, None)]
    if len(given) > 1:
        raise UsageError(f"{' and '.join('--' + name for name in given)} cannot be combined")
    if not given:
        return None
    flag = given[0]
    spec = args.vary if flag == "vary" else f"{_VARY_SHORTHANDS[flag]}={getattr(args, flag)}"
    shown = f"--{flag} {getattr(args, flag)!r}"
    key, sep, raw = spec.partition("=")
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not sep or not key.strip() or not values:
        raise UsageError(f"{shown}: expected {'KEY=V1,V2,...' if flag == 'vary' else 'V1,V2,...'}")
    if len(set(values)) != len(values):
        raise UsageError(f"{shown}: values repeat")
    return key.strip(), values


def _variants(
    schedulers: tuple[str, ...], config: SchedulerConfig, vary: tuple[str, list[str]] | None
) -> tuple[Variant, ...]:
    if vary is None:
        return tuple(Variant(name, name, config) for name in schedulers)
    key, values = vary
    variants = []
    for name in schedulers:
        for raw in values:
            change: dict[str, Any] = {}
            _put(change, key, parse_value(raw))
            if key.startswith("kv.") and config.kv is None:
                raise UsageError(f"--vary {key}: the config has no KV cache (kv=none); set kv.num_blocks first")
            label = raw if len(schedulers) == 1 else f"{name}/{raw}"
            variants.append(Variant(label, name, _apply(config, change, "--vary")))
    return tuple(variants)


def _schedulers(names: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [n for n in names if n not in SCHEDULERS]
    if unknown or not names:
        raise UsageError(f"unknown scheduler {', '.join(unknown) or '(none)'}; known: {', '.join(SCHEDULERS)}")
    if len(set(names)) != len(names):
        raise UsageError(f"scheduler names repeat: {', '.join(names)}")
    return names


def _slo(text: str) -> SLO:
    values: dict[str, float] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise UsageError(f"--slo {item!r}: expected ttft=X, tpot=X or e2e=X")
        try:
            values[key] = float(raw)
        except ValueError:
            raise UsageError(f"--slo {key}: not a number: {raw!r}") from None
    try:
        return SLO(**values)
    except ValueError as exc:
        raise UsageError(f"--slo: {exc}") from None
