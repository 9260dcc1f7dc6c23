"""Per-request export: one row per finished request, as JSON Lines or CSV.

This module owns the on-disk row layout (`REQUEST_COLUMNS`, then ``token_ts`` and
``token_counts`` in JSONL only). Timestamps and durations are in the run's own clock unit.

Invariants: output is deterministic for the same timelines: rows sorted by (arrival, request
id), columns in `REQUEST_COLUMNS` order, floats written with ``repr`` (JSON uses the same
shortest round-trip form), so ``float(cell)`` reads back the exact value; a missing value
(e.g. no first token) is JSON ``null`` and an empty CSV cell. An unfinished timeline raises
`ValueError`, as for every metric.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable

from contbatch.core.timeline import Timeline
from contbatch.metrics.request import request_metrics

REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id",
    "tenant",
    "priority",
    "num_prompt_tokens",
    "num_output_tokens",
    "arrival_ts",
    "first_scheduled_ts",
    "first_token_ts",
    "finished_ts",
    "queue_time",
    "requeue_time",
    "ttft",
    "tpot",
    "e2e",
    "num_preemptions",
    "finish_reason",
)

Row = dict[str, object]


def request_rows(timelines: Iterable[Timeline], *, with_tokens: bool = False) -> list[Row]:
    """One row per request, sorted by (arrival, id); `with_tokens` adds the token lists."""
    pairs = [(tl, request_metrics(tl)) for tl in timelines]
    pairs.sort(key=lambda pair: (pair[1].arrival_ts, pair[1].request_id))
    rows: list[Row] = []
    for tl, m in pairs:
        row: Row = dict(m.as_row())
        if with_tokens:
            row["token_ts"] = list(tl.token_ts)
            row["token_counts"] = list(tl.token_counts)
        rows.append(row)
    return rows


def write_requests_jsonl(timelines: Iterable[Timeline], path: str | os.PathLike[str]) -> None:
    """Write one JSON object per line, with the full ``token_ts`` and ``token_counts`` lists."""
    with open(path, "w", encoding="utf-8") as f:
        for row in request_rows(timelines, with_tokens=True):
            f.write(json.dumps(row, allow_nan=False) + "\n")


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_requests_csv(timelines: Iterable[Timeline], path: str | os.PathLike[str]) -> None:
    """Write a header of `REQUEST_COLUMNS` then one line per request (no token lists)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(REQUEST_COLUMNS)
        for row in request_rows(timelines):
            writer.writerow([_cell(row[col]) for col in REQUEST_COLUMNS])
