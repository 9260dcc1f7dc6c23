"""The table cost model: step times read from a measured (or generated) CSV grid.

File format (UTF-8 CSV, header first)::

    # Llama-2-7B on one A100-80GB, vLLM 0.6, measured 2024-06-01   <- '#' lines are comments
    num_prefill_tokens,num_decode_tokens,num_context_tokens,step_ms
    0,1,576,9.5
    0,32,18432,16.0
    512,0,512,38.0
    ...

- columns, in any order: ``num_prefill_tokens``, ``num_decode_tokens``, ``step_ms`` (required) and
  ``num_context_tokens`` (optional: without it the context is ignored); no other columns;
- token counts are integers >= 0; ``step_ms`` a finite number > 0 (milliseconds);
- the rows form a full grid: every combination of the distinct values of each column appears
  exactly once (P x D x C rows), so every cell interpolates between measured points;
- blank lines and lines whose first cell starts with ``#`` are skipped.

Lookup of a step (prefill = ``num_prefill_tokens + num_padding_tokens``, decode =
``num_decode_tokens``, context = ``num_context_tokens``):

1. context: the nearest grid value (ties go to the smaller one);
2. within that context slice, bilinear interpolation in (prefill, decode) between the four
   surrounding grid points; a coordinate outside the grid is clamped to its edge (so the table
   never extrapolates: cover the token budget you simulate);
3. plus ``swap_ms_per_block`` per swapped KV block (default 0.32 ms, `AffineCost`'s figure: an
   8 MiB block of a 7B fp16 model over ~25 GB/s PCIe).

At grid points the result is exactly the file's value. Errors are `CostSpecError` whose message
starts ``{file}:{line}: field '{column}': `` for a cell, ``{file}:{line}: `` for a row and
``{file}: `` for the file (a missing grid point names the combination).

Spec: ``table:PATH[,swap_ms_per_block=X]``.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import math
import os
import re
from dataclasses import dataclass

from contbatch.core.outputs import SchedulerOutput
from contbatch.sim.costs.errors import CostSpecError, check_number, float_param, split_params, split_path

PREFILL, DECODE, CONTEXT, STEP_MS = "num_prefill_tokens", "num_decode_tokens", "num_context_tokens", "step_ms"
TABLE_COLUMNS = (PREFILL, DECODE, CONTEXT, STEP_MS)
TABLE_PARAMS = ("swap_ms_per_block",)
_INTEGER = re.compile(r"\d+", re.ASCII)
_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


@dataclass(frozen=True, slots=True)
class TableCost:
    prefill_axis: tuple[int, ...]  # strictly increasing
    decode_axis: tuple[int, ...]  # strictly increasing
    context_axis: tuple[int, ...]  # strictly increasing; (0,) when the table ignores context
    step_ms: tuple[float, ...]  # (c * len(prefill_axis) + p) * len(decode_axis) + d -> ms; finite > 0
    source: str = "<table>"  # the file it came from, for reports
    swap_ms_per_block: float = 0.32

    def __post_init__(self) -> None:
        for name in ("prefill_axis", "decode_axis", "context_axis"):
            axis = getattr(self, name)
            if not axis or any(b <= a for a, b in itertools.pairwise(axis)):
                raise CostSpecError(f"table cost: {name} must be non-empty and strictly increasing, got {axis!r}")
        size = len(self.prefill_axis) * len(self.decode_axis) * len(self.context_axis)
        if len(self.step_ms) != size:
            raise CostSpecError(f"table cost: step_ms has {len(self.step_ms)} values, the axes need {size}")
        if not all(math.isfinite(v) and v > 0 for v in self.step_ms):
            raise CostSpecError("table cost: every step_ms must be a finite number > 0")
        check_number("table cost", "swap_ms_per_block", self.swap_ms_per_block)

    @property
    def time_unit(self) -> str:
        return "s"

    def step_time(self, out: SchedulerOutput) -> float:
        prefill = out.num_prefill_tokens + out.num_padding_tokens
        ms = self.lookup_ms(prefill, out.num_decode_tokens, out.num_context_tokens)
        return (ms + self.swap_ms_per_block * out.num_swapped_blocks) / 1000.0

    def lookup_ms(self, prefill: float, decode: float, context: float) -> float:
        """The interpolated step time in ms (no swap term)."""
        c = _nearest(self.context_axis, context)
        p0, p1, tp = _bracket(self.prefill_axis, prefill)
        d0, d1, td = _bracket(self.decode_axis, decode)
        base = c * len(self.prefill_axis)
        width = len(self.decode_axis)

        def at(p: int, d: int) -> float:
            return self.step_ms[(base + p) * width + d]

        low = (1.0 - td) * at(p0, d0) + td * at(p0, d1)
        high = (1.0 - td) * at(p1, d0) + td * at(p1, d1)
        return (1.0 - tp) * low + tp * high


def _nearest(axis: tuple[int, ...], x: float) -> int:
    i = bisect.bisect_left(axis, x)
    if i == 0:
        return 0
    if i == len(axis):
        return i - 1
    return i - 1 if x - axis[i - 1] <= axis[i] - x else i


def _bracket(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Indices around ``x`` (clamped to the axis) and its fraction of the way from the first to the second."""
    i = bisect.bisect_right(axis, x) - 1
    if i < 0:
        return 0, 0, 0.0
    if i >= len(axis) - 1:
        return len(axis) - 1, len(axis) - 1, 0.0
    return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])


# -- loading ---------------------------------------------------------------------------------------
def _error(label: str, problem: str, line: int | None = None, field: str | None = None) -> CostSpecError:
    where = label if line is None else f"{label}:{line}"
    column = "" if field is None else f"field '{field}': "
    return CostSpecError(f"{where}: {column}{problem}")


def load_table(path: str | os.PathLike[str], *, swap_ms_per_block: float = 0.32) -> TableCost:
    """Read a table CSV (format in the module docstring); CostSpecError names file, line and field."""
    label = os.fspath(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise _error(label, "no such file") from None
    except UnicodeDecodeError as exc:
        raise _error(label, f"not UTF-8 text (bad byte at offset {exc.start})") from None
    except OSError as exc:
        raise _error(label, f"cannot read: {exc.strerror or exc}") from None
    return parse_table_csv(text, label, swap_ms_per_block=swap_ms_per_block)


def parse_table_csv(text: str, label: str, *, swap_ms_per_block: float = 0.32) -> TableCost:
    records = _records(text, label)
    if not records:
        raise _error(label, "empty file: no header")
    header_line, header = records[0]
    _check_header(header, label, header_line)
    points: dict[tuple[int, int, int], tuple[float, int]] = {}  # (p, d, c) -> (ms, line)
    for line, cells in records[1:]:
        if len(cells) != len(header):
            raise _error(label, f"row has {len(cells)} cells, header has {len(header)}", line)
        row = dict(zip(header, cells, strict=True))
        key = (_count(row, PREFILL, label, line), _count(row, DECODE, label, line), _count(row, CONTEXT, label, line))
        if key in points:
            raise _error(label, f"duplicate grid point {_describe(key)} (first on line {points[key][1]})", line)
        points[key] = (_milliseconds(row.get(STEP_MS, ""), label, line), line)
    if not points:
        raise _error(label, "no data rows")
    return _grid(points, label, swap_ms_per_block)


def _records(text: str, label: str) -> list[tuple[int, list[str]]]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    records: list[tuple[int, list[str]]] = []
    try:
        for row in reader:
            cells = [cell.strip() for cell in row]
            if any(cells) and not cells[0].startswith("#"):
                records.append((reader.line_num, cells))
    except csv.Error as exc:
        raise _error(label, f"malformed CSV: {exc}", reader.line_num) from None
    return records


def _check_header(header: list[str], label: str, line: int) -> None:
    seen: set[str] = set()
    for column in header:
        if column not in TABLE_COLUMNS:
            raise _error(label, f"unknown column (expected some of {', '.join(TABLE_COLUMNS)})", line, column)
        if column in seen:
            raise _error(label, "column given twice", line, column)
        seen.add(column)
    for column in (PREFILL, DECODE, STEP_MS):
        if column not in seen:
            raise _error(label, "missing required column", line, column)


def _count(row: dict[str, str], column: str, label: str, line: int) -> int:
    if column not in row:  # only the optional context column may be absent
        return 0
    cell = row[column]
    if not _INTEGER.fullmatch(cell):
        raise _error(label, f"must be an integer >= 0, got {cell!r}", line, column)
    return int(cell)


def _milliseconds(cell: str, label: str, line: int) -> float:
    value = float(cell) if _NUMBER.fullmatch(cell) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise _error(label, f"must be a finite number > 0 (milliseconds), got {cell!r}", line, STEP_MS)
    return value


def _describe(key: tuple[int, int, int]) -> str:
    return f"({PREFILL}={key[0]}, {DECODE}={key[1]}, {CONTEXT}={key[2]})"


def _grid(points: dict[tuple[int, int, int], tuple[float, int]], label: str, swap_ms_per_block: float) -> TableCost:
    prefill = tuple(sorted({k[0] for k in points}))
    decode = tuple(sorted({k[1] for k in points}))
    context = tuple(sorted({k[2] for k in points}))
    values: list[float] = []
    for c in context:
        for p in prefill:
            for d in decode:
                found = points.get((p, d, c))
                if found is None:
                    raise _error(
                        label,
                        f"incomplete grid: no row for {_describe((p, d, c))}; the rows must cover every "
                        f"combination of the columns' values ({len(prefill)} x {len(decode)} x {len(context)})",
                    )
                values.append(found[0])
    return TableCost(prefill, decode, context, tuple(values), source=label, swap_ms_per_block=swap_ms_per_block)


def parse_table(args: str) -> TableCost:
    """The `TableCost` of ``PATH[,swap_ms_per_block=X]`` (the text after ``table:``)."""
    path, params = split_path(args)
    if not path:
        raise CostSpecError(f"table cost: expected table:PATH[,k=v...] with k in {', '.join(TABLE_PARAMS)}")
    values = split_params(params, known=TABLE_PARAMS, what="table cost")
    swap = float_param(values.get("swap_ms_per_block", "0.32"), "swap_ms_per_block", "table cost")
    return load_table(path, swap_ms_per_block=swap)
