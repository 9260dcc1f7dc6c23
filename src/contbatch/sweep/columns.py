"""The result columns of a sweep: which metrics each row holds, and which one ``--plot`` draws.

Columns are scalar keys of a run's summary (`contbatch.metrics.summarize` plus
`SimResult.run_stats`, what ``contbatch simulate --json`` prints per scheduler). A latency name
may drop its unit (``p99_ttft`` is ``p99_ttft_ms`` on a seconds clock, ``p99_ttft_ticks`` on a
tick clock). Names are checked against the keys of a one-request probe run of the first grid
point, so a typo fails before the sweep starts, with close matches suggested.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from contbatch.metrics import SLO
from contbatch.metrics.stats import STAT_PREFIXES, latency_suffix
from contbatch.metrics.summary import LATENCY_NAMES
from contbatch.sweep._reader import Reader
from contbatch.sweep.point import run_point
from contbatch.traces import Trace, TraceRequest

if TYPE_CHECKING:
    from contbatch.sweep.spec import SweepSpec

RESERVED_COLUMNS: tuple[str, ...] = ("point", "error")


def default_metrics(time_unit: str, slo: SLO | None) -> tuple[str, ...]:
    """The result columns when the file names none."""
    u = latency_suffix(time_unit)
    latency = [f"{p}_{n}_{u}" for n in ("ttft", "tpot") for p in ("mean", "median", "p99")]
    good = ("goodput", "slo_attainment") if slo is not None else ()
    return (
        "num_requests",
        "completed",
        "makespan",
        "request_throughput",
        "output_throughput",
        *good,
        *latency,
        f"mean_e2el_{u}",
        f"p99_e2el_{u}",
        "num_preemptions",
        "padding_waste",
        "kv_usage_mean",
        "kv_usage_max",
        "num_steps",
    )


def metric_name(name: str, time_unit: str, known: frozenset[str] | None = None) -> str:
    """`p99_ttft` → `p99_ttft_ms` (seconds clock) or `p99_ttft_ticks`; ValueError for a name
    that is not in `known` (when given) or is one of the reserved columns."""
    prefix, _, stem = name.partition("_")
    full = f"{name}_{latency_suffix(time_unit)}" if prefix in STAT_PREFIXES and stem in LATENCY_NAMES else name
    if full in RESERVED_COLUMNS or (known is not None and full not in known):
        close = difflib.get_close_matches(full, sorted(known or ()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown metric {name!r} (not a scalar key of a run's summary){hint}")
    return full


def probe_metrics(spec: SweepSpec) -> frozenset[str] | None:
    """The scalar result keys of a run like the first point's, from a one-request probe trace
    (with a deadline, so deadline keys count as known); None if the probe cannot run."""
    request = TraceRequest("probe", 0.0, num_prompt_tokens=1, num_output_tokens=2, deadline_ts=1e9)
    trace = Trace(name="probe", requests=(request,), time_unit=spec.time_unit, source="a sweep's metric probe")
    try:
        summary = run_point(trace, spec.task(spec.points[0]))
    except Exception:  # a probe that cannot run only means the names go unchecked
        return None
    if "error" in summary:
        return None
    return frozenset(k for k, v in summary.items() if not isinstance(v, Mapping | list))


def with_columns(reader: Reader, spec: SweepSpec, doc: dict[str, Any]) -> SweepSpec:
    known = probe_metrics(spec)
    names: tuple[str, ...] = default_metrics(spec.time_unit, spec.slo)
    if "metrics" in doc:
        names = reader.values("metrics", doc["metrics"])
    metrics = []
    for i, name in enumerate(names):
        where = f"metrics[{i}]" if "metrics" in doc else "metrics"
        text = reader.text(where, name)
        try:
            metrics.append(metric_name(text, spec.time_unit, known))
        except ValueError as exc:
            raise reader.fail(where, str(exc)) from None
    plot = reader.mapping("plot", doc.get("plot") or {})
    unknown = sorted(set(plot) - {"metric", "x"})
    if unknown:
        raise reader.fail(f"plot.{unknown[0]}", "unknown key; known: metric, x")
    text = reader.text("plot.metric", plot.get("metric", _default_plot_metric(spec)))
    try:
        plot_metric = metric_name(text, spec.time_unit, known)
    except ValueError as exc:
        raise reader.fail("plot.metric", str(exc)) from None
    plot_x = None if plot.get("x") is None else reader.text("plot.x", plot["x"]).replace("-", "_")
    if plot_x is not None and plot_x not in spec.axis_names:
        raise reader.fail("plot.x", f"{plot_x!r} is not a grid axis; axes: {', '.join(spec.axis_names) or '(none)'}")
    clash = [m for m in metrics if m in spec.axis_names]
    if clash:
        raise reader.fail("metrics", f"{clash[0]!r} is also an axis")
    columns = tuple(dict.fromkeys([*metrics, plot_metric]))
    return dataclasses.replace(spec, metrics=columns, plot_metric=plot_metric, plot_x=plot_x, known_metrics=known)


def _default_plot_metric(spec: SweepSpec) -> str:
    return "goodput" if spec.slo is not None else "output_throughput"


def with_plot_metric(spec: SweepSpec, name: str) -> SweepSpec:
    """`spec` plotting `name` instead (added to the columns); ValueError for an unknown metric."""
    metric = metric_name(name, spec.time_unit, spec.known_metrics)
    return dataclasses.replace(spec, plot_metric=metric, metrics=tuple(dict.fromkeys([*spec.metrics, metric])))
