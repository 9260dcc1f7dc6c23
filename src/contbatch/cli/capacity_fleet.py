"""`contbatch capacity --rate R` over fleets: the cheapest fleet meeting the SLO target at R
(`contbatch.sim.fleet_plan`), among homogeneous fleets of each `--kind`, heterogeneous mixes of
two kinds, and (`--disagg`) prefill/decode splits. The flags, their checks and the table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from contbatch.cli.options import RunOptions, UsageError, cost_model
from contbatch.metrics import format_number
from contbatch.routing import make_router, router_help
from contbatch.sim.cluster_config import LinkConfig
from contbatch.sim.fleet_plan import FleetCandidate, FleetPlan, FleetPlanner, ReplicaKind, cheapest_fleet
from contbatch.traces.synthetic import scale_to_rate


def add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    routers = router_help().replace("%", "%%")
    parser.add_argument("--routing", "--router", dest="routing", default="least_outstanding", metavar="SPEC",
                        help=f"the router of the replicas (decode replicas when disaggregated): {routers}")  # fmt: skip
    parser.add_argument(
        "--prefill-router", default="least_outstanding", metavar="SPEC", help="the prefill pool's router"
    )
    parser.add_argument("--price", type=float, default=1.0, help="price of one --cost replica per hour (default 1)")
    kind_help = (
        "another replica kind to plan with, its price per hour and cost model, e.g. 4.5:roofline:llama-2-7b@h100 "
        "(with --rate: the cheapest fleet over every kind)"
    )
    parser.add_argument("--kind", action="append", default=[], metavar="PRICE:COST", help=kind_help)
    parser.add_argument(
        "--disagg", action="store_true", help="with --rate: also plan prefill/decode disaggregated fleets"
    )
    parser.add_argument(
        "--threshold", type=int, default=0, help="disaggregate prompts of this many uncached tokens or more"
    )
    parser.add_argument("--link-bandwidth", type=float, default=LinkConfig().bandwidth, help="KV link bytes/s per port")
    parser.add_argument("--link-latency", type=float, default=LinkConfig().latency, help="KV link latency per transfer")
    parser.add_argument("--kv-bytes-per-token", type=float, help="KV bytes per token (default: the roofline model's)")
    parser.add_argument("--max-replicas", type=int, default=64, help="the largest fleet the search tries (default 64)")


def wants_fleet_plan(args: argparse.Namespace) -> bool:
    return bool(args.kind or args.disagg)


def check_fleet_flags(args: argparse.Namespace) -> None:
    for flag, spec in (("--routing", args.routing), ("--prefill-router", args.prefill_router)):
        try:
            make_router(spec)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    if wants_fleet_plan(args) and args.rate is None:
        raise UsageError("--kind and --disagg plan fleets for a rate: give --rate R")
    if not args.price >= 0 or args.max_replicas < 1 or args.threshold < 0:
        raise UsageError("--price must be >= 0, --max-replicas >= 1 and --threshold >= 0")


def _kinds(args: argparse.Namespace, opts: RunOptions) -> list[ReplicaKind]:
    kinds = [ReplicaKind.of(opts.cost_spec, opts.cost, args.price)]
    for item in args.kind:
        price, sep, spec = item.partition(":")
        try:
            value = float(price)
        except ValueError:
            value = -1.0
        if not sep or value < 0:
            raise UsageError(f"--kind {item!r}: expected PRICE:COST, e.g. 4.5:roofline:llama-2-7b@h100")
        cost = cost_model(spec)
        if cost.time_unit != opts.cost.time_unit:
            raise UsageError(f"--kind {item!r}: its clock is {cost.time_unit}, the --cost one's {opts.cost.time_unit}")
        kinds.append(ReplicaKind.of(spec, cost, value))
    names = [k.name for k in kinds]
    if len(set(names)) != len(names):
        raise UsageError(f"replica kinds repeat: {', '.join(names)}")
    return kinds


def run_fleet_plan(args: argparse.Namespace, opts: RunOptions) -> int:
    kinds = _kinds(args, opts)
    assert opts.slo is not None
    link = LinkConfig(args.link_bandwidth, args.link_latency, args.kv_bytes_per_token)
    planner = FleetPlanner(
        scale_to_rate(opts.trace, args.rate), opts.variants[0].config, opts.slo, args.target,
        scheduler=opts.variants[0].scheduler, router=args.routing, prefill_router=args.prefill_router, link=link,
        threshold=args.threshold, max_replicas=args.max_replicas,
    )  # fmt: skip
    try:
        plan = cheapest_fleet(planner, kinds, rate=args.rate, disaggregated=args.disagg)
    except ValueError as exc:  # a fleet that cannot be built (a link without bytes per token, ...)
        raise UsageError(str(exc)) from None
    unit = "ms" if opts.cost.time_unit == "s" else "ticks"
    document = _document(plan, opts, unit)
    print(json.dumps(document, indent=2) if opts.as_json else _text(document, opts, unit))
    if opts.out_dir is not None:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        (opts.out_dir / "capacity.json").write_text(json.dumps(document, indent=2) + "\n")
    if getattr(args, "plot", None) is not None:
        from contbatch.plots import plot_cost_goodput

        paths = plot_cost_goodput([_point(c) for c in plan.candidates], args.plot)
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


COLUMNS = (
    ("fleet", "label"),
    ("shape", "shape"),
    ("replicas", "num_replicas"),
    ("devices", "num_devices"),
    ("price/h", "price_per_hour"),
    ("attainment", "slo_attainment"),
    ("goodput", "goodput"),
    ("p99 TTFT", "p99_ttft_{unit}"),
    ("p99 TPOT", "p99_tpot_{unit}"),
    ("meets", "passes"),
)


def _row(candidate: FleetCandidate, unit: str) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, key in COLUMNS:
        row[name] = getattr(candidate, key) if hasattr(candidate, key) else candidate.summary.get(key.format(unit=unit))
    return row


def _point(candidate: FleetCandidate) -> tuple[str, float, float, bool]:
    goodput = candidate.summary.get("goodput")
    return (
        candidate.label,
        candidate.price_per_hour,
        float(goodput) if isinstance(goodput, int | float) else 0.0,
        candidate.passes,
    )


def _document(plan: FleetPlan, opts: RunOptions, unit: str) -> dict[str, Any]:
    assert opts.slo is not None
    cheapest = plan.cheapest
    return {
        "trace": opts.trace.name, "cost": opts.cost_spec, "slo": opts.slo.as_dict(), "target": plan.target,
        "rate": plan.rate, "cheapest": _row(cheapest, unit) if cheapest else None,
        "fleets": [_row(c, unit) for c in plan.candidates],
    }  # fmt: skip


def _text(document: dict[str, Any], opts: RunOptions, unit: str) -> str:
    rate_unit = "req/s" if opts.cost.time_unit == "s" else "req/tick"
    cheapest = document["cheapest"]
    lines = [f"trace: {opts.trace.name}   slo: {opts.slo}   target: {document['target']}   rate: "
             f"{format_number(document['rate'])} {rate_unit}"]  # fmt: skip
    if cheapest is None:
        lines.append("no fleet tried meets the target (raise --max-replicas?)")
    else:
        lines.append(f"cheapest fleet meeting the target: {cheapest['fleet']} ({format_number(cheapest['price/h'])}/h, "
                     f"{cheapest['devices']} devices)")  # fmt: skip
    header = [name if "TT" not in name and "TPOT" not in name else f"{name} ({unit})" for name, _ in COLUMNS]
    rows = [header] + [[_cell(r[name]) for name, _ in COLUMNS] for r in document["fleets"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["", *("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                    for r in rows)]  # fmt: skip
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value if isinstance(value, str) else format_number(value)
