"""Plain-text tables of `summarize` results: one run, or an A/B comparison of several.

This module owns presentation only; it computes nothing new. Rows name their unit: latencies in
``ms`` (seconds clock) or ``ticks`` (tick clock), makespan and rates in the run unit. Numbers are
compact: integral values print as integers (``11``, ``1``), others with at most three decimals
(``1.375``) or four significant digits below one (``0.0625``); a missing value prints ``-``.

Invariant: every summary in one table has the same ``time_unit`` (a `ValueError` otherwise), so
one label per row is true for every column.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from contbatch.core.status import FinishReason
from contbatch.metrics.stats import check_time_unit

# (label, key, always shown). "{unit}" is the run unit (s / tick), "{units}" its plural label
# (s / ticks), "{lat}" the latency-key unit (ms / ticks). A row not always shown appears when some
# summary has the key (and, for waste, a non-zero value).
_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("requests", "num_requests", True),
    ("  never ran (left out of latencies)", "num_not_run", False),
    ("makespan ({units})", "makespan", True),
    ("throughput (tok/{unit})", "output_throughput", True),
    ("request throughput (req/{unit})", "request_throughput", True),
    ("padding waste (tokens)", "padding_waste", True),
    ("unsent waste (tokens)", "unsent_waste", False),
    ("mean queue ({lat})", "mean_queue_{lat}", True),
    ("p50 queue ({lat})", "median_queue_{lat}", True),
    ("p99 queue ({lat})", "p99_queue_{lat}", True),
    ("mean TTFT ({lat})", "mean_ttft_{lat}", True),
    ("p50 TTFT ({lat})", "median_ttft_{lat}", True),
    ("p99 TTFT ({lat})", "p99_ttft_{lat}", True),
    ("mean TPOT ({lat})", "mean_tpot_{lat}", True),
    ("p50 TPOT ({lat})", "median_tpot_{lat}", True),
    ("p99 TPOT ({lat})", "p99_tpot_{lat}", True),
    ("mean ITL ({lat})", "mean_itl_{lat}", True),
    ("p99 ITL ({lat})", "p99_itl_{lat}", True),
    ("max ITL ({lat})", "max_itl_{lat}", True),
    ("mean E2E ({lat})", "mean_e2el_{lat}", True),
    ("p99 E2E ({lat})", "p99_e2el_{lat}", True),
    ("goodput (req/{unit})", "goodput", False),
    ("goodput (tok/{unit})", "goodput_tokens", False),
    ("SLO attainment", "slo_attainment", False),
    ("deadline misses", "num_deadline_misses", False),
    ("deadline attainment", "deadline_attainment", False),
    ("generated tokens", "generated_tokens", False),
    ("sent tokens", "sent_tokens", False),
    ("wasted tokens (generated, never sent)", "num_unsent_tokens", False),
    ("max tokens buffered for one client", "max_buffered_tokens", False),
    ("paused time (total, clock units)", "paused_time", False),
    # run-level figures from the scheduler (present in simulator results)
    ("mean KV usage (fraction)", "kv_usage_mean", False),
    ("max KV usage (fraction)", "kv_usage_max", False),
    ("preemptions", "num_preemptions", False),
    ("  by recompute", "num_recompute_preemptions", False),
    ("  by swap", "num_swap_outs", False),
    ("recomputed tokens", "num_recomputed_tokens", False),
    ("swapped blocks out", "num_swapped_out_blocks", False),
    ("swapped blocks in", "num_swapped_in_blocks", False),
    ("prefix cache hit rate", "prefix_hit_rate", False),
    ("prefill tokens saved", "num_prefix_hit_tokens", False),
    ("bucket padding (tokens)", "num_bucket_padding_tokens", False),
    ("draft acceptance rate", "draft_acceptance_rate", False),
)


def format_number(value: object) -> str:
    """Compact text for one table cell: ``11``, ``1.375``, ``0.0625``, ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return _format_float(value)
    return str(value)


def _format_float(value: float) -> str:
    if not math.isfinite(value):
        return repr(value)
    if value.is_integer():
        return str(int(value))
    if abs(value) >= 1:
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return f"{value:.4g}"


def _time_unit(summaries: Mapping[str, Mapping[str, object]]) -> str:
    units = {str(s.get("time_unit")) for s in summaries.values()}
    if len(units) != 1:
        raise ValueError(f"cannot compare summaries in different time units: {sorted(units)}")
    return check_time_unit(units.pop())


def _present(key: str, summaries: Mapping[str, Mapping[str, object]]) -> bool:
    """An optional row shows when some run has a non-zero value for it."""
    return any(s.get(key) not in (None, 0) for s in summaries.values())


def _reason_rows(summaries: Mapping[str, Mapping[str, object]]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = []
    for reason in FinishReason:
        counts: list[object] = []
        for s in summaries.values():
            reasons = s.get("finish_reasons")
            counts.append(reasons.get(reason.value, 0) if isinstance(reasons, Mapping) else 0)
        if any(c != 0 for c in counts):
            rows.append((f"finished: {reason.value}", [format_number(c) for c in counts]))
    return rows


def _rows(summaries: Mapping[str, Mapping[str, object]]) -> list[tuple[str, list[str]]]:
    unit = _time_unit(summaries)
    names = {"unit": unit, "units": "s" if unit == "s" else "ticks", "lat": "ms" if unit == "s" else "ticks"}
    rows: list[tuple[str, list[str]]] = []
    for label, key_template, always in _ROWS:
        key = key_template.format(**names)
        if always or _present(key, summaries):
            rows.append((label.format(**names), [format_number(s.get(key)) for s in summaries.values()]))
    return rows + _reason_rows(summaries) + _rejection_rows(summaries)


def _rejection_rows(summaries: Mapping[str, Mapping[str, object]]) -> list[tuple[str, list[str]]]:
    found = [s.get("rejections") for s in summaries.values()]
    counts = [dict(f) if isinstance(f, Mapping) else {} for f in found]
    kinds = sorted({kind for c in counts for kind in c})
    return [(f"rejected: {kind}", [format_number(c.get(kind, 0)) for c in counts]) for kind in kinds]


def _render(header: list[str], rows: list[tuple[str, list[str]]]) -> str:
    label_width = max(len(header[0]), *(len(label) for label, _ in rows))
    widths = [max(len(name), *(len(cells[i]) for _, cells in rows)) for i, name in enumerate(header[1:])]

    def line(label: str, cells: list[str]) -> str:
        padded = (cell.rjust(width) for cell, width in zip(cells, widths, strict=True))
        return "  ".join([label.ljust(label_width), *padded]).rstrip()

    lines = [line(header[0], header[1:]), line("-" * label_width, ["-" * w for w in widths])]
    lines += [line(label, cells) for label, cells in rows]
    return "\n".join(lines) + "\n"


def format_compare_table(summaries: Mapping[str, Mapping[str, object]]) -> str:
    """One table, one column per run name (e.g. scheduler), in the mapping's order."""
    if not summaries:
        raise ValueError("format_compare_table needs at least one summary")
    return _render(["metric", *summaries], _rows(summaries))


def format_summary(summary: Mapping[str, object], name: str = "value") -> str:
    """The same rows as `format_compare_table`, for a single run."""
    return format_compare_table({name: summary})


# Rows of a per-group block: (label, key, always shown); the optional ones show when some group
# summary has the key (an SLO was given), even at zero.
_GROUP_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("requests", "num_requests", True),
    ("completed", "completed", True),
    ("throughput (tok/{unit})", "output_throughput", True),
    ("mean TTFT ({lat})", "mean_ttft_{lat}", True),
    ("p50 TTFT ({lat})", "median_ttft_{lat}", True),
    ("p99 TTFT ({lat})", "p99_ttft_{lat}", True),
    ("mean TPOT ({lat})", "mean_tpot_{lat}", True),
    ("p99 TPOT ({lat})", "p99_tpot_{lat}", True),
    ("p99 E2E ({lat})", "p99_e2el_{lat}", True),
    ("goodput (req/{unit})", "goodput", False),
    ("SLO attainment", "slo_attainment", False),
    ("deadline misses", "num_deadline_misses", False),
    ("deadline attainment", "deadline_attainment", False),
    ("generated tokens", "generated_tokens", False),
    ("sent tokens", "sent_tokens", False),
    ("wasted tokens (generated, never sent)", "num_unsent_tokens", False),
    ("max tokens buffered for one client", "max_buffered_tokens", False),
    ("paused time (total, clock units)", "paused_time", False),
)


def _group_values(name_to_groups: Mapping[str, Mapping[str, Mapping[str, object]]], key: str) -> list[str]:
    """Every group value of any run: priorities ascending as numbers, tenants by name, "-" first."""
    values = {value for groups in name_to_groups.values() for value in groups}
    if key == "priority":
        return sorted(values, key=lambda v: (0, int(v), "") if v.lstrip("-").isdigit() else (1, 0, v))
    return sorted(values, key=lambda v: (v != "-", v))


def format_group_table(name_to_groups: Mapping[str, Mapping[str, Mapping[str, object]]], key: str) -> str:
    """Per-group results of several runs (e.g. `summarize_by` of each): one block per group
    value, one column per run in the mapping's order, so one tenant's (or priority's) numbers
    under each run sit side by side. A run without that group shows ``-``.
    """
    every = {f"{name}/{value}": s for name, groups in name_to_groups.items() for value, s in groups.items()}
    if not every:
        raise ValueError("format_group_table needs at least one run with at least one group")
    unit = _time_unit(every)
    names = {"unit": unit, "lat": "ms" if unit == "s" else "ticks"}
    rows = [(label.format(**names), template.format(**names), always) for label, template, always in _GROUP_ROWS]
    shown = [(label, k) for label, k, always in rows if always or any(k in s for s in every.values())]
    blocks = []
    for value in _group_values(name_to_groups, key):
        column = [groups.get(value, {}) for groups in name_to_groups.values()]
        cells = [(label, [format_number(s.get(k)) for s in column]) for label, k in shown]
        blocks.append(_render([f"{key} {value}", *name_to_groups], cells))
    return "\n".join(blocks)
