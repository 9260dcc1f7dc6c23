"""Command-line flags -> configs, in one place.

`RunOptions` is everything a `simulate` or `compare` run needs, resolved and validated: the
trace, the cost model, the scheduler config (a preset plus `--set` overrides), the scheduler
names and the SLO. Any bad value raises `UsageError` with one line that names it; the CLI
turns that into exit code 2.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contbatch.core import SCHEDULERS, ConfigError, SchedulerConfig, seed_config
from contbatch.core.config import PRESETS
from contbatch.metrics import SLO
from contbatch.sim.cost import CostModel, CostSpecError, UnitCost, parse_cost
from contbatch.traces import Trace, TraceError, builtin_trace_names, load_trace


class UsageError(ValueError):
    """A flag's value is invalid; the message is one line naming it."""


@dataclass(frozen=True, slots=True)
class RunOptions:
    trace: Trace
    cost_spec: str
    cost: CostModel
    preset: str
    config: SchedulerConfig
    schedulers: tuple[str, ...]
    slo: SLO | None
    as_json: bool
    out_dir: Path | None
    per_request: bool  # print / embed per-request TTFT, TPOT and completion


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(builtin_trace_names())
    parser.add_argument("--trace", default="seed", help=f"a built-in trace ({names}) or a .jsonl/.csv file")
    parser.add_argument(
        "--cost", default="unit:8", help="cost model: unit:C (C token-work per tick) or affine[:k=v,...] (seconds)"
    )
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
        help="scheduler config field, e.g. max_num_batched_tokens=4096, max_num_seqs=none, skip_blocked=true",
    )
    parser.add_argument("--slo", help="latency objectives for goodput, e.g. ttft=2,tpot=0.1,e2e=30 (clock unit)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", type=Path, help="also write results.json and per-request JSONL/CSV here")
    parser.add_argument(
        "--per-request",
        choices=("auto", "on", "off"),
        default="auto",
        help="per-request TTFT/TPOT/completion in the output (auto: on for traces of at most 64 requests)",
    )


def resolve(args: argparse.Namespace, schedulers: tuple[str, ...]) -> RunOptions:
    cost = _cost(args.cost)
    preset = args.preset or ("seed" if isinstance(cost, UnitCost) else "engine")
    trace = _trace(args.trace, cost.time_unit)
    per_request = {"on": True, "off": False}.get(args.per_request, len(trace) <= 64)
    return RunOptions(
        trace=trace,
        cost_spec=args.cost,
        cost=cost,
        preset=preset,
        config=_config(preset, cost, args.overrides),
        schedulers=_schedulers(schedulers),
        slo=_slo(args.slo) if args.slo else None,
        as_json=args.json,
        out_dir=args.out,
        per_request=per_request,
    )


def _cost(spec: str) -> CostModel:
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


def _config(preset: str, cost: CostModel, overrides: list[str]) -> SchedulerConfig:
    base = seed_config(cost.capacity) if preset == "seed" and isinstance(cost, UnitCost) else PRESETS[preset]
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        values[key.strip().replace("-", "_")] = _literal(raw.strip())
    try:
        return SchedulerConfig.from_dict(values, base=base)
    except ConfigError as exc:
        raise UsageError(f"--set: {exc}") from None


def _literal(raw: str) -> object:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return int(raw)
    except ValueError:
        return raw


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
