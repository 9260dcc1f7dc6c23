"""`contbatch capacity`: the highest request rate a configuration serves at an SLO, and how many
replicas a rate needs.

Without `--rate`: bisection over the trace scaled to other rates (`contbatch.sim.capacity`),
printing the rate found and the curve of every rate tried (SLO attainment, goodput, TTFT and
TPOT percentiles). With `--rate R`: the fewest replicas (behind a `--routing` router) meeting
the target at R. `--plot DIR` draws the curve; `--json` prints it as JSON. With `--rate R` and
`--kind PRICE:COST` or `--disagg`: the cheapest fleet meeting the target at R, over homogeneous,
heterogeneous and prefill/decode fleets (`contbatch.cli.capacity_fleet`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from contbatch.cli.capacity_fleet import add_fleet_flags, check_fleet_flags, run_fleet_plan, wants_fleet_plan
from contbatch.cli.options import RunOptions, UsageError, add_run_flags, resolve
from contbatch.core import make_scheduler
from contbatch.metrics import format_number
from contbatch.sim.capacity import CapacityPoint, Planner, find_capacity, replicas_needed

# (column, summary key; "{unit}" is the latency suffix: ms or ticks)
COLUMNS = (
    ("rate", ""),
    ("replicas", ""),
    ("attainment", "slo_attainment"),
    ("goodput", "goodput"),
    ("throughput", "request_throughput"),
    ("p50 TTFT", "median_ttft_{unit}"),
    ("p99 TTFT", "p99_ttft_{unit}"),
    ("p50 TPOT", "median_tpot_{unit}"),
    ("p99 TPOT", "p99_tpot_{unit}"),
)


def add_capacity_parser(commands: Any) -> None:
    capacity = commands.add_parser(
        "capacity",
        help="the highest request rate meeting an SLO, or the replicas a rate needs",
        description="Search the request rate (or the number of replicas) at which SLO attainment meets a target.",
    )
    capacity.add_argument("--scheduler", default="continuous", help="continuous (default) or static")
    capacity.add_argument("--target", type=float, default=0.9, help="SLO attainment to reach (default 0.9)")
    capacity.add_argument("--rate", type=float, help="find the replicas this rate needs (requests per time unit)")
    capacity.add_argument("--replicas", type=int, default=1, help="pool size for the rate search (default 1)")
    add_fleet_flags(capacity)
    add_run_flags(capacity)


def _checked(args: argparse.Namespace, opts: RunOptions) -> None:
    if opts.slo is None:
        raise UsageError("--slo is required, e.g. --slo ttft=2,tpot=0.1")
    if not 0.0 < args.target <= 1.0:
        raise UsageError(f"--target must be in (0, 1], got {args.target}")
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if args.rate is not None and not args.rate > 0:
        raise UsageError(f"--rate must be > 0, got {args.rate}")
    check_fleet_flags(args)
    if len(opts.trace) < 2 or opts.trace.requests[0].arrival_ts == opts.trace.requests[-1].arrival_ts:
        raise UsageError(f"--trace {opts.trace.name}: needs arrivals spread in time to be scaled to other rates")


def run_capacity_command(args: argparse.Namespace) -> int:
    try:
        opts = resolve(args, (args.scheduler,))
        _checked(args, opts)
        if wants_fleet_plan(args):
            return run_fleet_plan(args, opts)
    except UsageError as exc:
        print(f"contbatch capacity: error: {exc}", file=sys.stderr)
        return 2
    variant = opts.variants[0]
    assert opts.slo is not None
    planner = Planner(opts.trace, lambda: make_scheduler(variant.scheduler, variant.config), opts.cost, opts.slo,
                      routing=args.routing)  # fmt: skip
    if args.rate is None:
        found = find_capacity(planner, target=args.target, num_replicas=args.replicas)
        headline: dict[str, object] = {"max_rate": found.max_rate, "replicas": args.replicas}
        points = found.points
    else:
        needed, points = replicas_needed(planner, args.rate, target=args.target)
        headline = {"rate": args.rate, "replicas_needed": needed, "routing": args.routing}
    document = {"trace": opts.trace.name, "cost": opts.cost_spec, "slo": opts.slo.as_dict(), "target": args.target,
                **headline, "points": [_row(p, opts.cost.time_unit) for p in points]}  # fmt: skip
    print(json.dumps(document, indent=2) if opts.as_json else _text(document, opts))
    if opts.out_dir is not None:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        (opts.out_dir / "capacity.json").write_text(json.dumps(document, indent=2) + "\n")
    if getattr(args, "plot", None) is not None:
        _plot(points, Path(args.plot), variant.label)
    return 0


def _row(point: CapacityPoint, time_unit: str) -> dict[str, object]:
    unit = "ms" if time_unit == "s" else "ticks"
    row: dict[str, object] = {"rate": point.rate, "replicas": point.num_replicas}
    for name, key in COLUMNS[2:]:
        row[name] = point.summary.get(key.format(unit=unit))
    return row


def _text(document: dict[str, Any], opts: RunOptions) -> str:
    unit = "ms" if opts.cost.time_unit == "s" else "ticks"
    rate_unit = "req/s" if opts.cost.time_unit == "s" else "req/tick"
    lines = [
        f"trace: {opts.trace.name}   cost: {opts.cost_spec}   slo: {opts.slo}   target: {document['target']}",
    ]
    if "max_rate" in document:
        lines.append(f"highest rate meeting the target: {format_number(document['max_rate'])} {rate_unit} "
                     f"on {document['replicas']} replica(s)")  # fmt: skip
    else:
        lines.append(f"replicas needed at {format_number(document['rate'])} {rate_unit}: "
                     f"{document['replicas_needed'] or 'more than 1024'} ({document['routing']})")  # fmt: skip
    header = [name if "TTFT" not in name and "TPOT" not in name else f"{name} ({unit})" for name, _ in COLUMNS]
    rows = [header] + [[format_number(p[name]) for name, _ in COLUMNS] for p in document["points"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["", *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)]
    return "\n".join(lines)


def _plot(points: tuple[CapacityPoint, ...], out_dir: Path, label: str) -> None:
    from contbatch.plots import plot_capacity

    curve = [(p.rate, p.summary) for p in points]
    paths = plot_capacity({label: curve}, out_dir)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
