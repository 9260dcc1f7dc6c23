"""Helpers shared by the third-party CSV importers (Vidur, BurstGPT): locating the columns an
importer needs in a header that may carry others, and reading their cells.

Every error is a `TraceError` naming the file, the 1-based line and the file's column name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from contbatch.traces._common import Where

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_INTEGRAL = re.compile(r"[+-]?\d+(?:\.0*)?", re.ASCII)


def locate_columns(
    header: Sequence[str], where: Where, *, required: Sequence[str], optional: Sequence[str] = ()
) -> dict[str, int]:
    """Column name -> index for the required and optional columns; other columns are ignored.

    A known column given twice or a required one missing is an error naming the column.
    """
    known = (*required, *optional)
    found: dict[str, int] = {}
    for index, column in enumerate(header):
        if column in known:
            if column in found:
                raise where.error("column given twice", column)
            found[column] = index
    for column in required:
        if column not in found:
            raise where.error("missing required column", column)
    return found


def check_width(cells: Sequence[str], header: Sequence[str], where: Where) -> None:
    if len(cells) != len(header):
        raise where.error(f"row has {len(cells)} cells, header has {len(header)}")


def decimal_cell(cell: str, where: Where, column: str) -> Fraction:
    """A plain decimal (``12``, ``0.5``, ``1e3``), exactly; anything else is an error naming the column."""
    if not _DECIMAL.fullmatch(cell):
        shown = "missing required value" if not cell else f"must be a number, got {cell!r}"
        raise where.error(shown, column)
    return Fraction(cell)


def token_cell(cell: str) -> object:
    """The int a token-count cell spells (``12`` or pandas' ``12.0``), else the cell itself, so that
    the schema rejects it by name."""
    if _INTEGRAL.fullmatch(cell):
        return int(Fraction(cell))
    return cell
