"""Importer for the Azure LLM inference trace 2023 CSV format.

The format (Azure Public Dataset, ``AzureLLMInferenceTrace_{code,conv}.csv``) has the header
``TIMESTAMP,ContextTokens,GeneratedTokens`` (any column order) and one row per request, e.g.
``2023-11-16 18:17:03.9799600,4808,10``: a naive wall-clock invocation time with up to 9
fractional digits (the dataset uses 7, finer than `datetime`'s microseconds), prompt tokens and
output tokens.

Invariants of the imported trace:
- timestamps are converted to integer nanoseconds, so arrivals are exact up to one float
  rounding of ``(ns - origin_ns) / 1e9``: no drift beyond the microsecond, whatever the row;
- the origin is the earliest timestamp, which is the first row's in a time-sorted file such as
  the published ones, so the first arrival is 0 and no arrival is negative;
- ids are ``azure-0``, ``azure-1``, ... by data row in file order (blank lines not counted),
  and requests are then sorted by arrival, stably;
- rows must have ``ContextTokens`` and ``GeneratedTokens`` >= 1 (the schema's rule).
"""

from __future__ import annotations

import datetime
import re

from contbatch.traces._common import (
    PathArg,
    Where,
    assemble_trace,
    build_request,
    check_header,
    csv_table,
    integer_cell,
    load_file,
)
from contbatch.traces.schema import Trace, TraceRequest

AZURE_HEADER: tuple[str, ...] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# TraceRequest attribute -> the Azure column it comes from, for error messages.
_FIELD_NAMES = {
    "arrival_ts": "TIMESTAMP",
    "num_prompt_tokens": "ContextTokens",
    "num_output_tokens": "GeneratedTokens",
}
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?", re.ASCII)
_NS_PER_S = 10**9
_EXAMPLE = "2023-11-16 18:17:03.9799600"


def import_azure_csv(
    path: PathArg, *, time_unit: str = "s", name: str | None = None, source: str | None = None
) -> Trace:
    """Import an Azure LLM inference trace CSV; the name defaults to the file stem."""
    return load_file(
        parse_azure_csv,
        path,
        time_unit=time_unit,
        name=name,
        source=source,
        default_source="file {file} (Azure LLM inference trace format)",
    )


def parse_azure_csv(text: str, label: str, *, name: str, time_unit: str, source: str) -> Trace:
    """Parse Azure-format CSV ``text``; ``label`` names the file in error messages."""
    where, header, records = csv_table(text, label)
    check_header(header, where, allowed=AZURE_HEADER, required=AZURE_HEADER)
    rows: list[tuple[int, int, TraceRequest]] = []  # (line, timestamp ns, request at arrival 0)
    for line, cells in records:
        if any(cells):
            where = Where(label, line)
            timestamp_ns, request = _parse_row(header, cells, where, f"azure-{len(rows)}")
            rows.append((line, timestamp_ns, request))
    origin_ns = min((ns for _, ns, _ in rows), default=0)
    located = [
        # int / int is correctly rounded: the only float error is this one rounding.
        (line, request.replace(arrival_ts=(ns - origin_ns) / _NS_PER_S))
        for line, ns, request in rows
    ]
    return assemble_trace(label, located, name=name, time_unit=time_unit, source=source, field_names=_FIELD_NAMES)


def _parse_row(header: list[str], cells: list[str], where: Where, request_id: str) -> tuple[int, TraceRequest]:
    if len(cells) != len(header):
        raise where.error(f"row has {len(cells)} cells, header has {len(header)}")
    row = dict(zip(header, cells, strict=True))
    for column in AZURE_HEADER:
        if not row[column]:
            raise where.error("missing required value", column)
    try:
        timestamp_ns = parse_timestamp_ns(row["TIMESTAMP"])
    except ValueError:
        raise where.error(f"not a timestamp like '{_EXAMPLE}', got {row['TIMESTAMP']!r}", "TIMESTAMP") from None
    values = {
        "request_id": request_id,
        "arrival_ts": 0.0,  # set once the origin is known; the row is validated now, in file order
        "num_prompt_tokens": integer_cell(row["ContextTokens"]),
        "num_output_tokens": integer_cell(row["GeneratedTokens"]),
    }
    return timestamp_ns, build_request(values, where, _FIELD_NAMES)


def parse_timestamp_ns(text: str) -> int:
    """Integer nanoseconds since 0001-01-01 00:00 of ``YYYY-MM-DD HH:MM:SS[.fffffffff]``.

    Exact for up to 9 fractional digits; raises ValueError for anything else, including
    impossible dates and times.
    """
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        raise ValueError(f"not a timestamp: {text!r}")
    day = datetime.date.fromisoformat(match[1])
    clock = datetime.time(int(match[2]), int(match[3]), int(match[4]))
    seconds = (day.toordinal() - 1) * 86_400 + clock.hour * 3_600 + clock.minute * 60 + clock.second
    fraction_ns = int((match[5] or "").ljust(9, "0"))
    return seconds * _NS_PER_S + fraction_ns
