"""A sweep's results table: one row per grid point, written as CSV and JSON, printed as text.

A row is ``point`` (the grid index), each axis's value (named as the axis: ``scheduler``,
``rate``, ``kv.admission``, ...), each metric column of the spec, then ``error`` (None, or why
the point did not run to the end; its metrics are then None). Rows are in grid order and hold
only inputs and simulated results, never timing or runner details, so the same file gives the
same bytes whoever ran it. In CSV a None is an empty cell and a list value is written ``a/b``;
JSON keeps lists and nulls.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contbatch.metrics import format_number
from contbatch.sweep.run import SweepResult
from contbatch.sweep.spec import SweepSpec

CSV_NAME = "sweep.csv"
JSON_NAME = "sweep.json"


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def columns(spec: SweepSpec) -> list[str]:
    return ["point", *spec.axis_names, *spec.metrics, "error"]


def rows(result: SweepResult) -> list[dict[str, Any]]:
    """The table: one dict per grid point, keys in `columns` order."""
    spec = result.spec
    table = []
    for point, summary in zip(spec.points, result.summaries, strict=True):
        row: dict[str, Any] = {"point": point.index}
        row.update((name, _plain(value)) for name, value in point.values)
        row.update((metric, _plain(summary.get(metric))) for metric in spec.metrics)
        row["error"] = summary.get("error")
        table.append(row)
    return table


def document(result: SweepResult) -> dict[str, object]:
    """The JSON document: what was swept (trace, axes, fixed settings) and the rows."""
    spec = result.spec
    return {
        "name": spec.name,
        "trace": {
            "name": spec.trace.name,
            "num_requests": len(spec.trace),
            "time_unit": spec.trace.time_unit,
            "source": spec.trace.source,
        },
        "preset": spec.preset,
        "set": {k: _plain(v) for k, v in spec.overrides.items()},
        "axes": {axis.name: [_plain(v) for v in axis.values] for axis in spec.axes},
        "slo": None if spec.slo is None else spec.slo.as_dict(),
        "spec_acceptance": spec.acceptance_rate,
        "seed": spec.seed,
        "columns": columns(spec),
        "rows": rows(result),
    }


def to_json(doc: Mapping[str, object]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False, default=_plain)


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return "/".join(str(v) for v in value)
    return str(value)


def write_results(result: SweepResult, out_dir: str | Path) -> tuple[Path, Path]:
    """``sweep.csv`` and ``sweep.json`` in `out_dir` (created if needed); returns their paths."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = directory / CSV_NAME, directory / JSON_NAME
    table = rows(result)
    with csv_path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(columns(result.spec))
        writer.writerows([_cell(v) for v in row.values()] for row in table)
    json_path.write_text(to_json(document(result)) + "\n", encoding="utf-8")
    return csv_path, json_path


def text_table(result: SweepResult, metrics: Sequence[str] | None = None) -> str:
    """An aligned text table: the axes and `metrics` (default: the plot metric and a few
    headline metrics that are columns)."""
    spec = result.spec
    shown = list(metrics) if metrics is not None else _headline(spec)
    header = ["point", *spec.axis_names, *shown]
    lines = [header]
    for row in rows(result):
        cells = [str(row["point"]), *(_cell(row[a]) for a in spec.axis_names)]
        if row["error"] is not None:
            cells += ["error: " + str(row["error"])]
        else:
            cells += [format_number(row[m]) for m in shown]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in lines)


def _headline(spec: SweepSpec) -> list[str]:
    u = "ms" if spec.time_unit == "s" else "ticks"
    wanted = [spec.plot_metric, "output_throughput", "goodput", f"p99_ttft_{u}", f"p99_tpot_{u}"]
    return [m for m in dict.fromkeys(wanted) if m in spec.metrics]
