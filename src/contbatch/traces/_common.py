"""Plumbing shared by the file loaders: reading text, locating errors, assembling a `Trace`.

Owns the canonical field names (the JSONL keys and CSV columns) and how they map onto
`TraceRequest` attributes, so a schema error raised by the constructor can be reported under the
name the user actually wrote. Every error leaving this module is a `TraceError` that names the
file (and, for a row, the 1-based line and the field).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contbatch.traces.schema import (
    TIME_UNITS,
    RequestValueError,
    Trace,
    TraceError,
    TraceRequest,
    fractional_tick_time,
    tick_time_problem,
)

# Canonical file field -> TraceRequest attribute, in the order files list them.
CANONICAL_FIELDS: dict[str, str] = {
    "id": "request_id",
    "arrival": "arrival_ts",
    "prompt_tokens": "num_prompt_tokens",
    "output_tokens": "num_output_tokens",
    "priority": "priority",
    "tenant": "tenant",
    "deadline": "deadline_ts",
    "max_tokens": "max_output_tokens",
    "prefix_group": "prefix_group",
    "prefix_tokens": "prefix_tokens",
    "cancel_at": "cancel_ts",
    "read_rate": "read_rate",
}
REQUIRED_FIELDS: tuple[str, ...] = ("id", "arrival", "prompt_tokens", "output_tokens")
ATTRIBUTE_TO_FIELD: dict[str, str] = {attr: name for name, attr in CANONICAL_FIELDS.items()}

PathArg = str | os.PathLike[str]

_INTEGER = re.compile(r"[+-]?\d+", re.ASCII)
_EXACT_INT_LIMIT = 2**53  # every integer below this magnitude is exactly a float


@dataclass(frozen=True, slots=True)
class Where:
    """A row's location, for error messages: the file label and its 1-based line."""

    file: str
    line: int

    def error(self, problem: str, field: str | None = None) -> TraceError:
        return TraceError(problem, file=self.file, line=self.line, field=field)


def check_time_unit(time_unit: str, label: str) -> None:
    if time_unit not in TIME_UNITS:
        expected = ", ".join(TIME_UNITS)
        raise TraceError(f"unknown time unit {time_unit!r}: expected one of {expected}", file=label)


def read_text(path: PathArg) -> str:
    """The file's text (UTF-8, a BOM dropped, line endings kept for the csv module)."""
    label = os.fspath(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            return handle.read()
    except FileNotFoundError:
        raise TraceError("no such file", file=label) from None
    except IsADirectoryError:
        raise TraceError("is a directory, not a trace file", file=label) from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"not UTF-8 text (bad byte at offset {exc.start})", file=label) from None
    except OSError as exc:
        raise TraceError(f"cannot read: {exc.strerror or exc}", file=label) from None


def default_name(label: str) -> str:
    return Path(label).stem


def csv_records(text: str, label: str) -> list[tuple[int, list[str]]]:
    """Every CSV record with the 1-based line it ends on; cells stripped of surrounding blanks."""
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        return [(reader.line_num, [cell.strip() for cell in row]) for row in reader]
    except csv.Error as exc:
        raise TraceError(f"malformed CSV: {exc}", file=label, line=reader.line_num) from None


def csv_table(text: str, label: str) -> tuple[Where, list[str], list[tuple[int, list[str]]]]:
    """A CSV file as (where its header is, the header, the records after it); an empty file is
    a `TraceError`."""
    records = csv_records(text, label)
    if not records:
        raise TraceError("empty file: no header", file=label)
    header_line, header = records[0]
    return Where(label, header_line), header, records[1:]


def check_header(header: Sequence[str], where: Where, *, allowed: Sequence[str], required: Sequence[str]) -> None:
    """Reject unknown, repeated and missing columns, naming the column."""
    seen: set[str] = set()
    for column in header:
        if column not in allowed:
            raise where.error(f"unknown column (expected some of {', '.join(allowed)})", column)
        if column in seen:
            raise where.error("column given twice", column)
        seen.add(column)
    for column in required:
        if column not in seen:
            raise where.error("missing required column", column)


def integer_cell(cell: str) -> object:
    """The int a CSV cell spells, or the cell itself so that the schema rejects it by name."""
    if _INTEGER.fullmatch(cell):
        try:
            return int(cell)
        except ValueError:  # more digits than int() will convert
            pass
    return cell


def number_value(value: float) -> int | float:
    """``value`` as files write it: whole numbers as ints (3, not 3.0), others unchanged.

    Below 2**53 the int converts back to the same float, and floats are written with Python's
    shortest round-tripping repr, so a written number always loads back bit-exact.
    """
    if value.is_integer() and abs(value) < _EXACT_INT_LIMIT:
        return int(value)
    return value


def build_request(values: Mapping[str, Any], where: Where, field_names: Mapping[str, str]) -> TraceRequest:
    """Construct a request, reporting a schema violation under the file's own field name."""
    try:
        return TraceRequest(**values)
    except RequestValueError as exc:
        raise where.error(exc.problem, field_names.get(exc.field, exc.field)) from None


def assemble_trace(
    label: str,
    located: Sequence[tuple[int, TraceRequest]],
    *,
    name: str,
    time_unit: str,
    source: str,
    field_names: Mapping[str, str] = ATTRIBUTE_TO_FIELD,
) -> Trace:
    """The trace of ``located`` (line, request) pairs; rejects an empty file, duplicate ids and,
    in ticks, a time that is not a whole number (named by the file's own field name, from
    `field_names`: see `schema.check_whole_ticks`)."""
    if not located:
        raise TraceError("empty trace: no requests", file=label)
    if time_unit == "tick" or len({request.request_id for _, request in located}) != len(located):
        _check_rows(label, located, time_unit, field_names)  # (ids all distinct in seconds: nothing to name)
    return Trace(name=name, requests=tuple(r for _, r in located), time_unit=time_unit, source=source)


def _check_rows(
    label: str, located: Sequence[tuple[int, TraceRequest]], time_unit: str, field_names: Mapping[str, str]
) -> None:
    """`assemble_trace`'s checks row by row: the first duplicate id, or in ticks the first
    fractional time, as a `TraceError` naming its line(s)."""
    first_line: dict[str, int] = {}
    for line, request in located:
        previous = first_line.setdefault(request.request_id, line)
        if previous != line:
            raise TraceError(f"duplicate id {request.request_id!r} on lines {previous} and {line}", file=label)
        if time_unit == "tick":
            field = fractional_tick_time(request)
            if field is not None:
                raise Where(label, line).error(tick_time_problem(request, field), field_names.get(field, field))


def load_file(
    parse: Callable[..., Trace],
    path: PathArg,
    *,
    time_unit: str,
    name: str | None,
    source: str | None,
    default_source: str | None,
) -> Trace:
    """Read the trace file `path` and `parse(text, label, name=, time_unit=, source=)` it. The
    name defaults to the file stem; the source to `default_source` with ``{file}`` replaced by the
    path (None: left to the parser)."""
    label = os.fspath(path)
    check_time_unit(time_unit, label)
    if source is None and default_source is not None:
        source = default_source.format(file=label)
    return parse(read_text(path), label, name=default_name(label) if name is None else name, time_unit=time_unit,
                 source=source)  # fmt: skip
