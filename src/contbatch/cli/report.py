"""Running schedulers on one trace and presenting their results (text, JSON, files).

Every scheduler of a comparison runs the same trace, cost model and config through the same
simulator loop and the same metrics; the JSON document is deterministic (same inputs, same
bytes). Per-group results (`RunOptions.group_by`) come from `summarize_by` over the same
timelines and SLO: a table per key after the main one, ``by_tenant`` / ``by_priority`` in JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contbatch.cli.options import RunOptions
from contbatch.core import make_scheduler
from contbatch.metrics import per_request_table
from contbatch.sim.loop import SimResult, simulate

if TYPE_CHECKING:
    from contbatch.plots import StepPoint, StepSeries

# (the per-group tables, the exports and the plots are imported where a flag asks for them:
# `--by`, `--out`, `--plot`; a plain run loads none of them)

UNIT_NAMES = {"s": "seconds", "tick": "ticks"}


@dataclass(frozen=True, slots=True)
class Outcome:
    sim: SimResult
    summary: dict[str, object]
    groups: dict[str, dict[str, dict[str, object]]]  # group key -> group value -> group summary
    steps: tuple[StepPoint, ...] = ()  # one point per step, kept only when plotting (--plot)


def run_all(opts: RunOptions) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    for variant in opts.variants:
        scheduler = make_scheduler(variant.scheduler, variant.config)
        series = _step_series() if opts.plot_dir is not None else None
        sim = simulate(
            opts.trace,
            scheduler,
            opts.cost,
            acceptance_rate=opts.acceptance_rate,
            observers=[series] if series is not None else (),
            keep_timelines=not opts.streaming,
        )
        summary = sim.summary(opts.slo)
        summary.update(sim.run_stats())
        groups = {key: _summarize_by(sim, key, opts) for key in opts.group_by}
        steps = tuple(series.points) if series is not None else ()
        outcomes[variant.label] = Outcome(sim, summary, groups, steps)
    return outcomes


def _step_series() -> StepSeries:
    from contbatch.plots import StepSeries

    return StepSeries()


def _summarize_by(sim: SimResult, key: str, opts: RunOptions) -> dict[str, dict[str, object]]:
    from contbatch.metrics.groups import summarize_by

    return summarize_by(sim.timelines, key, time_unit=sim.time_unit, slo=opts.slo)


def per_request(sim: SimResult) -> dict[str, dict[str, float | None]]:
    """The seed's per-request dicts: TTFT, TPOT and completion time by request id."""
    rows = per_request_table(sim.timelines)
    return {
        "ttft": {m.request_id: m.ttft for m in rows},
        "tpot": {m.request_id: m.tpot for m in rows},
        "completion": {m.request_id: m.completion_ts for m in rows},
    }


def to_document(opts: RunOptions, outcomes: Mapping[str, Outcome]) -> dict[str, object]:
    results: dict[str, object] = {}
    for name, outcome in outcomes.items():
        entry = dict(outcome.summary)
        entry.update({f"by_{key}": groups for key, groups in outcome.groups.items()})
        if opts.per_request:
            entry["per_request"] = per_request(outcome.sim)
        results[name] = entry
    return {
        "trace": {
            "name": opts.trace.name,
            "num_requests": len(opts.trace),
            "time_unit": opts.trace.time_unit,
            "source": opts.trace.source,
        },
        "cost": opts.cost_spec,
        "preset": opts.preset,
        "scheduler_config": dataclasses.asdict(opts.config),
        "variants": {
            v.label: {"scheduler": v.scheduler, "config": dataclasses.asdict(v.config)} for v in opts.variants
        },
        "slo": None if opts.slo is None else opts.slo.as_dict(),
        "results": results,
    }


def to_json(document: Mapping[str, object]) -> str:
    return json.dumps(document, indent=2, sort_keys=False, allow_nan=False)


def _changed_fields(config: object, base: object, prefix: str = "") -> list[str]:
    """`key=value` for every field of `config` that differs from `base` (nested configs dotted)."""
    if not dataclasses.is_dataclass(config) or not dataclasses.is_dataclass(base) or type(config) is not type(base):
        return [f"{prefix.rstrip('.')}={config}"] if config != base else []
    changed: list[str] = []
    for f in dataclasses.fields(config):
        changed += _changed_fields(getattr(config, f.name), getattr(base, f.name), f"{prefix}{f.name}.")
    return [c.replace(".=", "=") for c in changed]


def to_text(opts: RunOptions, outcomes: Mapping[str, Outcome]) -> str:
    from contbatch.metrics.compare import format_compare_table, format_group_table

    changed = _changed_fields(opts.config, opts.preset_config)
    trace = opts.trace
    lines = [
        f"trace: {trace.name} ({len(trace)} requests, in {UNIT_NAMES[trace.time_unit]}) - {trace.source}",
        f"cost: {opts.cost_spec}   preset: {opts.preset}" + (f" with {', '.join(changed)}" if changed else ""),
        "",
        format_compare_table({name: o.summary for name, o in outcomes.items()}),
    ]
    for key in opts.group_by:
        lines += [f"per {key}:", "", format_group_table({name: o.groups[key] for name, o in outcomes.items()}, key)]
    if opts.per_request:
        lines += [_per_request_text(outcomes)]
    return "\n".join(lines)


def _per_request_text(outcomes: Mapping[str, Outcome]) -> str:
    from contbatch.metrics.compare import format_number

    names = list(outcomes)
    tables = {name: per_request(o.sim) for name, o in outcomes.items()}
    ids = list(tables[names[0]]["ttft"])
    header = ["request"] + [f"{n} {col}" for n in names for col in ("ttft", "tpot", "done")]
    rows = [header]
    for rid in ids:
        row = [rid]
        for name in names:
            row += [format_number(tables[name][col][rid]) for col in ("ttft", "tpot", "completion")]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows)


def write_plots(opts: RunOptions, outcomes: Mapping[str, Outcome]) -> None:
    """--plot DIR: the request timeline (small traces), latency CDFs, KV usage and batch size."""
    if opts.plot_dir is None:
        return
    from contbatch.plots import write_run_plots

    write_run_plots(
        {name: o.sim.timelines for name, o in outcomes.items()},
        opts.plot_dir,
        time_unit=opts.trace.time_unit,
        steps={name: o.steps for name, o in outcomes.items()},
        slo=opts.slo,
        title=f"{opts.trace.name} ({opts.cost_spec})",
    )


def write_out_dir(opts: RunOptions, outcomes: Mapping[str, Outcome], document: Mapping[str, object]) -> None:
    write_plots(opts, outcomes)
    if opts.out_dir is None:
        return
    from contbatch.metrics.export import write_requests_csv, write_requests_jsonl

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / "results.json").write_text(to_json(document) + "\n")
    for name, outcome in outcomes.items():
        write_requests_jsonl(outcome.sim.timelines, opts.out_dir / f"requests-{name}.jsonl")
        write_requests_csv(outcome.sim.timelines, opts.out_dir / f"requests-{name}.csv")
