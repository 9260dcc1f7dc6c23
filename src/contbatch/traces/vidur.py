"""Importer for Vidur's trace-replay CSV (``TraceReplayRequestGenerator``'s ``trace_file``).

The format (microsoft/vidur, e.g. its ``data/processed_traces/*.csv``) has one row per request
with the columns ``arrived_at`` (seconds from the trace start), ``num_prefill_tokens`` (prompt)
and ``num_decode_tokens`` (output), in any order; any other column (``num_total_tokens``,
``pd_ratio``, a pandas index, ...) is ignored.

Invariants of the imported trace:
- arrivals are the file's ``arrived_at`` values as they are (not shifted: Vidur replays them from
  time 0 too), plain decimals >= 0;
- token counts are integers >= 1 (``12.0``, as pandas writes integer columns that held a
  missing value, is read as 12); Vidur clips a 0 to 1 when it replays, this importer rejects it
  with the line and the column, like every other schema violation;
- ids are ``vidur-0``, ``vidur-1``, ... by data row in file order (blank lines not counted),
  and requests are then sorted by arrival, stably.
"""

from __future__ import annotations

from contbatch.traces._columns import check_width, decimal_cell, locate_columns, token_cell
from contbatch.traces._common import (
    PathArg,
    Where,
    assemble_trace,
    build_request,
    csv_table,
    load_file,
)
from contbatch.traces.schema import Trace, TraceRequest

VIDUR_COLUMNS: tuple[str, ...] = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
_FIELD_NAMES = {
    "arrival_ts": "arrived_at",
    "num_prompt_tokens": "num_prefill_tokens",
    "num_output_tokens": "num_decode_tokens",
}


def import_vidur_csv(
    path: PathArg, *, time_unit: str = "s", name: str | None = None, source: str | None = None
) -> Trace:
    """Import a Vidur trace-replay CSV; the name defaults to the file stem."""
    return load_file(
        parse_vidur_csv,
        path,
        time_unit=time_unit,
        name=name,
        source=source,
        default_source="file {file} (Vidur trace-replay format)",
    )


def parse_vidur_csv(text: str, label: str, *, name: str, time_unit: str, source: str) -> Trace:
    """Parse Vidur-format CSV ``text``; ``label`` names the file in error messages."""
    where, header, records = csv_table(text, label)
    columns = locate_columns(header, where, required=VIDUR_COLUMNS)
    located: list[tuple[int, TraceRequest]] = []
    for line, cells in records:
        if not any(cells):
            continue
        where = Where(label, line)
        check_width(cells, header, where)
        values = {
            "request_id": f"vidur-{len(located)}",
            "arrival_ts": float(decimal_cell(cells[columns["arrived_at"]], where, "arrived_at")),
            "num_prompt_tokens": token_cell(cells[columns["num_prefill_tokens"]]),
            "num_output_tokens": token_cell(cells[columns["num_decode_tokens"]]),
        }
        located.append((line, build_request(values, where, _FIELD_NAMES)))
    return assemble_trace(label, located, name=name, time_unit=time_unit, source=source, field_names=_FIELD_NAMES)
