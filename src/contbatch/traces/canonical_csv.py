"""The canonical CSV trace format: a header naming the JSONL keys as columns.

Columns: ``arrival``, ``prompt_tokens``, ``output_tokens`` (required), ``id``, ``priority``,
``tenant``, ``deadline``, ``max_tokens``, ``prefix_group``, ``prefix_tokens``, ``cancel_at``,
``read_rate`` (optional; the JSONL keys of the same names, see `contbatch.traces.jsonl`), in any
order; the header is line 1. Rules:

- cells are stripped of surrounding blanks; an empty optional cell means absent, an empty
  required cell is an error;
- without an ``id`` column, ids are the 0-based data-row index as strings ("0", "1", ...);
  blank lines are skipped and not counted;
- every row has exactly as many cells as the header (a lost comma shifts columns, so a short
  row is an error, not a row of absents);
- unknown or repeated columns are errors; numbers are plain decimals (no ``nan``, ``inf`` or
  ``1_000``), token counts and priority plain integers.

Line numbers in errors are the line a record ends on (a quoted cell may span lines).

`write_csv` writes ``id``, the required columns and every optional column some request uses, with
CRLF line ends (RFC 4180; it makes the csv module quote a lone carriage return). Invariant:
``load_csv(write_csv(trace))`` gives back ``trace.requests`` exactly; a text field with
surrounding blanks cannot survive the stripping above, so `write_csv` refuses it.
"""

from __future__ import annotations

import csv
import re
from typing import Any

from contbatch.traces._common import (
    ATTRIBUTE_TO_FIELD,
    CANONICAL_FIELDS,
    PathArg,
    Where,
    assemble_trace,
    build_request,
    check_header,
    csv_table,
    integer_cell,
    load_file,
)
from contbatch.traces.jsonl import request_to_json
from contbatch.traces.schema import Trace, TraceRequest

REQUIRED_COLUMNS: tuple[str, ...] = ("arrival", "prompt_tokens", "output_tokens")
_INTEGER_COLUMNS = frozenset({"prompt_tokens", "output_tokens", "priority", "max_tokens", "prefix_tokens"})
_NUMBER_COLUMNS = frozenset({"arrival", "deadline", "cancel_at", "read_rate"})
_TEXT_COLUMNS = ("id", "tenant", "prefix_group")
_WRITTEN_ALWAYS = ("id", *REQUIRED_COLUMNS)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def load_csv(path: PathArg, *, time_unit: str = "s", name: str | None = None, source: str | None = None) -> Trace:
    """Load a canonical CSV trace; the name defaults to the file stem."""
    return load_file(
        parse_canonical_csv, path, time_unit=time_unit, name=name, source=source, default_source="file {file}"
    )


def parse_canonical_csv(text: str, label: str, *, name: str, time_unit: str, source: str) -> Trace:
    """Parse canonical CSV ``text``; ``label`` names the file in error messages."""
    where, header, records = csv_table(text, label)
    check_header(header, where, allowed=tuple(CANONICAL_FIELDS), required=REQUIRED_COLUMNS)
    located: list[tuple[int, TraceRequest]] = []
    for line, cells in records:
        if any(cells):
            where = Where(label, line)
            values = _row_values(header, cells, where)
            values.setdefault("request_id", str(len(located)))
            located.append((line, build_request(values, where, ATTRIBUTE_TO_FIELD)))
    return assemble_trace(label, located, name=name, time_unit=time_unit, source=source)


def _row_values(header: list[str], cells: list[str], where: Where) -> dict[str, Any]:
    """Constructor arguments from one row, keyed by `TraceRequest` attribute."""
    if len(cells) < len(header):
        missing = header[len(cells)]
        raise where.error(f"missing cell (row has {len(cells)} cells, header has {len(header)})", missing)
    if len(cells) > len(header):
        raise where.error(f"row has {len(cells)} cells, header has {len(header)}")
    values: dict[str, Any] = {}
    for column, cell in zip(header, cells, strict=True):
        if not cell:
            if column in REQUIRED_COLUMNS or column == "id":
                raise where.error("missing required value", column)
            continue
        values[CANONICAL_FIELDS[column]] = _cell_value(column, cell)
    return values


def _cell_value(column: str, cell: str) -> object:
    # A cell that does not parse is passed on as text, so the schema rejects it with the same
    # message a JSONL file would get ("must be an integer >= 1, got '3.5'").
    if column in _INTEGER_COLUMNS:
        return integer_cell(cell)
    if column in _NUMBER_COLUMNS and _NUMBER.fullmatch(cell):
        return float(cell)
    return cell


def write_csv(trace: Trace, path: PathArg) -> None:
    """Write ``trace.requests`` as canonical CSV (name, unit and source are not stored).

    Raises ValueError for an id, tenant or prefix group with surrounding blanks, which the
    loader would strip.
    """
    rows = [_csv_cells(request) for request in trace.requests]
    header = [c for c in CANONICAL_FIELDS if c in _WRITTEN_ALWAYS or any(row[c] for row in rows)]
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\r\n")
        writer.writerow(header)
        writer.writerows([row[column] for column in header] for row in rows)


def _csv_cells(request: TraceRequest) -> dict[str, str]:
    """Every canonical column's cell for ``request``: "" where the field is at its default."""
    json_object = request_to_json(request)
    cells: dict[str, str] = {}
    for column in CANONICAL_FIELDS:
        value = json_object.get(column)
        cell = "" if value is None else str(value)
        if column in _TEXT_COLUMNS and cell != cell.strip():
            problem = f"{column} {cell!r} has surrounding blanks, which CSV loading strips"
            raise ValueError(f"request {request.request_id!r}: cannot write to CSV: {problem}")
        cells[column] = cell
    return cells
