"""Per-group results: the metrics of `summary`, split by tenant or by priority.

This module owns the grouping and the group-level definitions; every per-request metric comes
from `request.request_metrics` and every statistic from `stats.latency_keys`, so a group's
``p99_ttft_ms`` means exactly what the run's does, over the group's requests only.

- group value: the request's tenant (None shows as ``"-"``) or its priority (as text, ``"2"``).
  Groups are ordered tenants by name (``"-"`` first), priorities ascending as numbers.
- counts, tokens, finish reasons and latency statistics: as in `summary`, over the group.
  ``finish_reasons`` holds only the reasons that occur in the group. Latency statistics cover
  the group's requests that ran (`RequestMetrics.ran`), as the run's do: a rejected request is
  counted in ``finish_reasons`` and enters no latency.
- output_throughput = the group's output tokens / the makespan of the WHOLE run (last FINISHED −
  first ARRIVED over every request, not over the group's). A group's rate is its share of the
  run's rate, so the groups' ``output_throughput`` (and ``goodput``, ``goodput_tokens``) add up to
  the run's. A rate over a group's own span would not add up and would reward a tenant that
  arrives in one short burst.
- goodput / slo_attainment: as in `summary` (the same `SLO.is_met_by`), goodput over the whole
  run's makespan, attainment as a fraction of the group's requests; present only with an SLO.
- service = prompt tokens of the requests that ran (`RequestMetrics.ran`) +
  every output token emitted: the token-work a fair-share scheduler equalises across tenants.
  Its total over the groups is ``total_input_tokens + total_output_tokens`` of the run.

Invariants: the same as `summarize` (an empty input, an unfinished timeline or a duplicate id
raises `ValueError`; values are plain JSON types, never NaN), plus: an unknown group key raises
`ValueError`, and every group has at least one request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics.columns import columns_of_rows
from contbatch.metrics.request import RequestMetrics, request_metrics
from contbatch.metrics.stats import check_time_unit, latency_keys, latency_suffix
from contbatch.metrics.summary import SLO, _goodput_keys, _metrics_of, _per_unit, run_makespan

GROUP_KEYS: Final[tuple[str, ...]] = ("tenant", "priority")
"""The request attributes results can be grouped by."""

NO_TENANT: Final[str] = "-"
"""The group value of requests without a tenant."""

# (latency stem, statistics kept) of a group summary: fewer than the run summary, to stay compact.
_GROUP_LATENCIES: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("ttft", ("mean", "median", "p90", "p99", "max")),
    ("tpot", ("mean", "median", "p99")),
    ("e2el", ("mean", "median", "p99")),
)
_GOODPUT_KEYS: Final[tuple[str, ...]] = ("num_good_requests", "goodput", "goodput_tokens", "slo_attainment")


def _check_key(key: str) -> str:
    if key not in GROUP_KEYS:
        raise ValueError(f"cannot group by {key!r}: expected one of {GROUP_KEYS}")
    return key


def _sort_key(key: str) -> Callable[[RequestMetrics], tuple[int, str]]:
    """Group order of a request: tenants by name (no tenant first), priorities ascending."""
    if key == "priority":
        return lambda m: (m.priority, "")
    return lambda m: (0, "") if m.tenant is None else (1, m.tenant)


def group_value(m: RequestMetrics, key: str) -> str:
    """The text group value of one request: its tenant (``"-"`` for none) or its priority."""
    if _check_key(key) == "priority":
        return str(m.priority)
    return NO_TENANT if m.tenant is None else m.tenant


def _split(rows: list[RequestMetrics], key: str) -> dict[str, list[RequestMetrics]]:
    """Requests by group value, groups in order (dicts keep insertion order)."""
    _check_key(key)
    groups: dict[str, list[RequestMetrics]] = {}
    for m in sorted(rows, key=_sort_key(key)):
        groups.setdefault(group_value(m, key), []).append(m)
    return groups


def _group_summary(rows: list[RequestMetrics], makespan: float, time_unit: str, slo: SLO | None) -> dict[str, object]:
    reasons = {reason.value: sum(1 for m in rows if m.finish_reason is reason) for reason in FinishReason}
    total_output = sum(m.num_output_tokens for m in rows)
    summary: dict[str, object] = {
        "time_unit": time_unit,
        "num_requests": len(rows),
        "completed": sum(1 for m in rows if m.succeeded),
        "finish_reasons": {reason: count for reason, count in reasons.items() if count},
        "total_output_tokens": total_output,
        # the group's tokens over the WHOLE run's makespan: the groups add up to the run
        "output_throughput": _per_unit(total_output, makespan),
    }
    ran = [m for m in rows if m.ran]  # latencies cover the requests that ran, as in `summary`
    samples: dict[str, list[float]] = {
        "ttft": [m.ttft for m in ran if m.ttft is not None],
        "tpot": [m.tpot for m in ran if m.tpot is not None],
        "e2el": [m.e2e for m in ran],
    }
    suffix = latency_suffix(time_unit)
    for stem, prefixes in _GROUP_LATENCIES:
        stats = latency_keys(stem, samples[stem], time_unit)
        summary.update({key: stats[key] for key in (f"{prefix}_{stem}_{suffix}" for prefix in prefixes)})
    if slo is not None:
        goodput = _goodput_keys(columns_of_rows(rows), makespan, slo)
        summary.update({k: goodput[k] for k in _GOODPUT_KEYS})
    return summary


def summarize_by(
    timelines: Iterable[Timeline], key: str, *, time_unit: str, slo: SLO | None = None
) -> dict[str, dict[str, object]]:
    """{group value: compact summary} of finished timelines, grouped by `key` ("tenant" or
    "priority"), groups in order. Rates are over the whole run's makespan (see the module doc).

    Raises `ValueError` for an unknown key or time unit, and as `summarize` does.
    """
    _check_key(key)
    check_time_unit(time_unit)
    rows = _metrics_of(timelines)
    makespan = run_makespan(columns_of_rows(rows))
    return {value: _group_summary(group, makespan, time_unit, slo) for value, group in _split(rows, key).items()}


def service_by(timelines: Iterable[Timeline], key: str) -> dict[str, int]:
    """{group value: tokens of service}: prompt tokens of requests that ran + output tokens emitted.

    Groups in the order of `summarize_by`; an empty input gives ``{}``. Raises `ValueError` for
    an unknown key or an unfinished timeline.
    """
    _check_key(key)
    rows = [request_metrics(tl) for tl in timelines]
    return {
        value: sum((m.num_prompt_tokens if m.ran else 0) + m.num_output_tokens for m in group)
        for value, group in _split(rows, key).items()
    }
