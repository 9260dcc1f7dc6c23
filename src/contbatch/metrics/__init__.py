"""contbatch.metrics: pure functions from per-request timelines to numbers and tables.

Owns every metric definition (queue time, TTFT, TPOT, ITL, E2E in `request`; makespan,
throughput, goodput and waste in `summary`; the same split by tenant or priority, and tokens of
service per group, in `groups`; the per-request fields as numpy columns for the vectorised
summary in `columns`), their presentation (`compare`) and per-request export
(`export`). It reads `contbatch.core` types and uses numpy; it never imports the simulator, the
engine or the server, and never reads a clock: timestamps come in the unit the run states ("s"
or "tick").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contbatch.lazy import lazy_names
from contbatch.metrics.request import (
    SUCCESS_REASONS,
    RequestMetrics,
    per_request_table,
    request_metrics,
)
from contbatch.metrics.stats import TIME_UNITS, describe
from contbatch.metrics.streaming import StreamingSummary
from contbatch.metrics.summary import SLO, summarize, summarize_rows

if TYPE_CHECKING:
    from contbatch.metrics.compare import format_compare_table, format_group_table, format_number, format_summary
    from contbatch.metrics.export import (
        REQUEST_COLUMNS,
        request_rows,
        write_requests_csv,
        write_requests_jsonl,
    )
    from contbatch.metrics.groups import GROUP_KEYS, NO_TENANT, service_by, summarize_by

# presentation, export and groups, imported on first use: a run's summary needs none of them
_LAZY = {
    "format_compare_table": "compare",
    "format_group_table": "compare",
    "format_number": "compare",
    "format_summary": "compare",
    "REQUEST_COLUMNS": "export",
    "request_rows": "export",
    "write_requests_csv": "export",
    "write_requests_jsonl": "export",
    "GROUP_KEYS": "groups",
    "NO_TENANT": "groups",
    "service_by": "groups",
    "summarize_by": "groups",
}


__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "GROUP_KEYS",
    "NO_TENANT",
    "REQUEST_COLUMNS",
    "SLO",
    "SUCCESS_REASONS",
    "TIME_UNITS",
    "RequestMetrics",
    "StreamingSummary",
    "describe",
    "format_compare_table",
    "format_group_table",
    "format_number",
    "format_summary",
    "per_request_table",
    "request_metrics",
    "request_rows",
    "service_by",
    "summarize",
    "summarize_by",
    "summarize_rows",
    "write_requests_csv",
    "write_requests_jsonl",
]
