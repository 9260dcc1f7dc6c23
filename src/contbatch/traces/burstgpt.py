"""Importer for the BurstGPT trace CSV (HPMLL/BurstGPT, ``BurstGPT_*.csv``).

The format has the header ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
and one row per request, e.g. ``5,ChatGPT,472,18,490,Conversation log``: seconds from the start
of the collection, the serving model (ChatGPT or GPT-4), prompt and output tokens, their sum,
and whether the request came from the conversation service or the API.

Rules:
- ``Timestamp``, ``Request tokens`` and ``Response tokens`` are required; ``Model`` is optional
  and becomes the request's tenant (so results can be grouped by model); ``Total tokens``,
  ``Log Type`` and any other column (newer releases add ``SessionID``, ``Elapsed time``) are
  ignored; columns may come in any order;
- rows whose ``Response tokens`` is 0 are failed requests: they are skipped and their count is
  stated in the trace's source line (the ``BurstGPT_without_fails_*.csv`` files have none);
- arrivals are the timestamps shifted so that the earliest is 0 (the second release's files start
  two months in), computed exactly from the decimal text and rounded once;
- ids are ``burstgpt-N`` with ``N`` the 0-based data row in file order, failures included, so an
  id points back at its row; requests are then sorted by arrival, stably;
- token counts are integers (``12.0`` reads as 12); a prompt of 0 tokens or a negative count is
  an error naming the line and the column, like every other schema violation.
"""

from __future__ import annotations

from fractions import Fraction

from contbatch.traces._columns import check_width, decimal_cell, locate_columns, token_cell
from contbatch.traces._common import (
    PathArg,
    Where,
    assemble_trace,
    build_request,
    csv_table,
    load_file,
)
from contbatch.traces.schema import Trace, TraceError, TraceRequest

BURSTGPT_HEADER: tuple[str, ...] = (
    "Timestamp",
    "Model",
    "Request tokens",
    "Response tokens",
    "Total tokens",
    "Log Type",
)
_REQUIRED = ("Timestamp", "Request tokens", "Response tokens")
_FIELD_NAMES = {
    "arrival_ts": "Timestamp",
    "num_prompt_tokens": "Request tokens",
    "num_output_tokens": "Response tokens",
    "tenant": "Model",
}


def import_burstgpt_csv(
    path: PathArg, *, time_unit: str = "s", name: str | None = None, source: str | None = None
) -> Trace:
    """Import a BurstGPT CSV; the name defaults to the file stem."""
    return load_file(parse_burstgpt_csv, path, time_unit=time_unit, name=name, source=source, default_source=None)


def parse_burstgpt_csv(text: str, label: str, *, name: str, time_unit: str, source: str | None = None) -> Trace:
    """Parse BurstGPT CSV ``text``; ``source`` defaults to the file and the number of failures skipped."""
    where, header, records = csv_table(text, label)
    columns = locate_columns(header, where, required=_REQUIRED, optional=("Model",))
    rows: list[tuple[int, Fraction, TraceRequest]] = []  # (line, timestamp, request at arrival 0)
    num_rows = num_failed = 0
    for line, cells in records:
        if not any(cells):
            continue
        where = Where(label, line)
        check_width(cells, header, where)
        request_id = f"burstgpt-{num_rows}"
        num_rows += 1
        output = token_cell(cells[columns["Response tokens"]])
        if output == 0:
            num_failed += 1
            continue
        timestamp = decimal_cell(cells[columns["Timestamp"]], where, "Timestamp")
        model = cells[columns["Model"]] if "Model" in columns else ""
        values = {
            "request_id": request_id,
            "arrival_ts": 0.0,  # set once the origin is known; the row is validated now, in file order
            "num_prompt_tokens": token_cell(cells[columns["Request tokens"]]),
            "num_output_tokens": output,
            "tenant": model or None,
        }
        rows.append((line, timestamp, build_request(values, where, _FIELD_NAMES)))
    if num_rows and not rows:
        raise TraceError(f"no requests: all {num_rows} rows are failures (zero response tokens)", file=label)
    origin = min((ts for _, ts, _ in rows), default=Fraction(0))
    located = [(line, r.replace(arrival_ts=float(ts - origin))) for line, ts, r in rows]
    if source is None:
        skipped = f"{num_failed} of {num_rows} rows skipped as failures (zero response tokens)"
        source = f"file {label} (BurstGPT format); {skipped}"
    return assemble_trace(label, located, name=name, time_unit=time_unit, source=source, field_names=_FIELD_NAMES)
