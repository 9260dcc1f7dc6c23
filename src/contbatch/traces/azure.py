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
import functools
import re
from collections.abc import Callable

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
    rows = [(line, cells) for line, cells in records if any(cells)]
    # The origin first (every timestamp read; a bad one is reported below, in its row's turn),
    # then each request built once, with its arrival, row by row in file order.
    stamps = list(map(_timestamp_of(header), (cells for _, cells in rows)))
    origin_ns = min((ns for ns in stamps if ns is not None), default=0)
    located = [
        (line, _parse_row(header, cells, Where(label, line), f"azure-{index}", timestamp_ns=ns, origin_ns=origin_ns))
        for index, ((line, cells), ns) in enumerate(zip(rows, stamps, strict=True))
    ]
    return assemble_trace(label, located, name=name, time_unit=time_unit, source=source, field_names=_FIELD_NAMES)


def _timestamp_of(header: list[str]) -> Callable[[list[str]], int | None]:
    """A row's timestamp in ns, or None for a row whose timestamp cannot be read."""
    column = header.index("TIMESTAMP")

    def timestamp(cells: list[str]) -> int | None:
        try:
            return parse_timestamp_ns(cells[column]) if len(cells) == len(header) else None
        except ValueError:
            return None

    return timestamp


def _parse_row(
    header: list[str], cells: list[str], where: Where, request_id: str, *, timestamp_ns: int | None, origin_ns: int
) -> TraceRequest:
    if len(cells) != len(header):
        raise where.error(f"row has {len(cells)} cells, header has {len(header)}")
    row = dict(zip(header, cells, strict=True))
    for column in AZURE_HEADER:
        if not row[column]:
            raise where.error("missing required value", column)
    if timestamp_ns is None:
        raise where.error(f"not a timestamp like '{_EXAMPLE}', got {row['TIMESTAMP']!r}", "TIMESTAMP")
    values = {
        "request_id": request_id,
        # int / int is correctly rounded: the only float error is this one rounding.
        "arrival_ts": (timestamp_ns - origin_ns) / _NS_PER_S,
        "num_prompt_tokens": integer_cell(row["ContextTokens"]),
        "num_output_tokens": integer_cell(row["GeneratedTokens"]),
    }
    return build_request(values, where, _FIELD_NAMES)


def parse_timestamp_ns(text: str) -> int:
    """Integer nanoseconds since 0001-01-01 00:00 of ``YYYY-MM-DD HH:MM:SS[.fffffffff]``.

    Exact for up to 9 fractional digits; raises ValueError for anything else, including
    impossible dates and times.
    """
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        raise ValueError(f"not a timestamp: {text!r}")
    hour, minute, second = int(match[2]), int(match[3]), int(match[4])
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError(f"not a time of day: {text!r}")
    seconds = _days_before(match[1]) * 86_400 + hour * 3_600 + minute * 60 + second
    fraction_ns = int((match[5] or "").ljust(9, "0"))
    return seconds * _NS_PER_S + fraction_ns


@functools.lru_cache(maxsize=64)
def _days_before(day: str) -> int:
    """Days from 0001-01-01 to the date `day` (``YYYY-MM-DD``); ValueError for no such date.
    (Cached: a trace's rows share a few days.)"""
    return datetime.date.fromisoformat(day).toordinal() - 1
