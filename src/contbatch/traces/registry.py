"""Trace lookup: built-in traces by name, files by extension (and, for CSV, by header).

`load_trace(spec)` resolves ``spec`` in this order:

1. a built-in name (`builtin_trace_names()`): built-ins win over a file of the same name, so
   write ``./seed`` to load such a file;
2. an existing file: ``.jsonl`` is canonical JSONL; ``.csv`` is sniffed by its header, the Azure
   header (a ``TIMESTAMP`` column) going to the Azure importer, Vidur's (an ``arrived_at``
   column) to the Vidur importer, BurstGPT's (a ``Response tokens`` column) to the BurstGPT
   importer and one made of canonical columns to the canonical CSV loader; any other extension
   or header is a `TraceError`;
3. anything else is a `TraceError` naming the built-ins.

``time_unit`` overrides the unit of built-ins and files alike (files default to seconds); it
relabels the numbers, it does not rescale them. Relabelled to ticks, every time must be a whole
number (`schema.check_whole_ticks`): a fractional one is a `TraceError` naming the request.

Built-ins: ``seed`` (the specification's worked example, in ticks), ``azure-code`` (the shipped
Azure trace, in seconds) and the synthetic scenarios of `contbatch.traces.scenarios`
(``kv-pressure``, ``long-prompt``, ``multi-tenant``, ``priority-mix``, ``deadlines``,
``cancel-storm``, ``slow-readers``, ``prefix-share``; seconds, generated from fixed seeds).
They are immutable and cached, so loading one twice costs one parse or one generation.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path

from contbatch.traces._common import (
    CANONICAL_FIELDS,
    PathArg,
    check_time_unit,
    csv_table,
    default_name,
    read_text,
)
from contbatch.traces.jsonl import load_jsonl
from contbatch.traces.scenarios import SCENARIOS
from contbatch.traces.schema import Trace, TraceError, TraceRequest, check_whole_ticks

# (the CSV importers and the package-data reader are imported where a .csv file or the shipped
# Azure trace is read: loading a JSONL file or a generated trace needs none of them)

AZURE_CODE_FILE = "AzureLLMInferenceTrace_code_2023.csv"
AZURE_CODE_SOURCE = (
    "Azure LLM inference trace 2023, code service (Azure Public Dataset, CC-BY 4.0); "
    'Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024'
)
SEED_SOURCE = (
    "the contbatch specification's worked example: A=(0,4,5), B=(0,2,2), C=(3,3,4) "
    "as (arrival, prompt tokens, output tokens), token-work budget 8 per tick"
)


def _seed_trace() -> Trace:
    requests = (
        TraceRequest("A", arrival_ts=0.0, num_prompt_tokens=4, num_output_tokens=5),
        TraceRequest("B", arrival_ts=0.0, num_prompt_tokens=2, num_output_tokens=2),
        TraceRequest("C", arrival_ts=3.0, num_prompt_tokens=3, num_output_tokens=4),
    )
    return Trace(name="seed", requests=requests, time_unit="tick", source=SEED_SOURCE)


@functools.cache
def _azure_code_trace() -> Trace:
    from importlib import resources

    from contbatch.traces.azure import parse_azure_csv

    resource = resources.files("contbatch.traces").joinpath("data").joinpath(AZURE_CODE_FILE)
    text = resource.read_text(encoding="utf-8")
    return parse_azure_csv(text, AZURE_CODE_FILE, name="azure-code", time_unit="s", source=AZURE_CODE_SOURCE)


_BUILTINS: dict[str, Callable[[], Trace]] = {
    "seed": _seed_trace,
    "azure-code": _azure_code_trace,
    **SCENARIOS,
}


def builtin_trace_names() -> tuple[str, ...]:
    """Names `load_trace` accepts without a file, in a stable order (for help and errors)."""
    return tuple(_BUILTINS)


def load_trace(spec: PathArg, *, time_unit: str | None = None) -> Trace:
    """The trace named by ``spec``: a built-in name or a path to a .jsonl or .csv file."""
    if isinstance(spec, str) and spec in _BUILTINS:
        return _builtin(spec, time_unit)
    label = os.fspath(spec)
    path = Path(label)
    if not path.exists():
        names = ", ".join(_BUILTINS)
        raise TraceError(f"unknown trace {label!r}: not a built-in ({names}) and no such file")
    unit = "s" if time_unit is None else time_unit
    check_time_unit(unit, label)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return load_jsonl(label, time_unit=unit)
    if suffix == ".csv":
        return _load_sniffed_csv(label, unit)
    shown = repr(suffix) if suffix else "without an extension"
    raise TraceError(f"unknown trace format {shown}: expected a .jsonl or .csv file", file=label)


def _builtin(name: str, time_unit: str | None) -> Trace:
    trace = _BUILTINS[name]()
    if time_unit is None or time_unit == trace.time_unit:
        return trace
    check_time_unit(time_unit, name)
    return check_whole_ticks(dataclasses.replace(trace, time_unit=time_unit), file=name)


def _load_sniffed_csv(label: str, time_unit: str) -> Trace:
    from contbatch.traces.azure import AZURE_HEADER, parse_azure_csv
    from contbatch.traces.burstgpt import BURSTGPT_HEADER, parse_burstgpt_csv
    from contbatch.traces.canonical_csv import parse_canonical_csv
    from contbatch.traces.vidur import VIDUR_COLUMNS, parse_vidur_csv

    text = read_text(label)
    _, header, _ = csv_table(text, label)
    name = default_name(label)
    if "TIMESTAMP" in header:
        source = f"file {label} (Azure LLM inference trace format)"
        return parse_azure_csv(text, label, name=name, time_unit=time_unit, source=source)
    if "arrived_at" in header:
        source = f"file {label} (Vidur trace-replay format)"
        return parse_vidur_csv(text, label, name=name, time_unit=time_unit, source=source)
    if "Response tokens" in header:
        return parse_burstgpt_csv(text, label, name=name, time_unit=time_unit)
    if set(header) & set(CANONICAL_FIELDS):
        return parse_canonical_csv(text, label, name=name, time_unit=time_unit, source=f"file {label}")
    canonical = ",".join(CANONICAL_FIELDS)
    raise TraceError(
        f"unrecognised CSV header {','.join(header)!r}: expected the canonical columns {canonical!r} "
        f"(arrival, prompt_tokens, output_tokens required), the Azure header {','.join(AZURE_HEADER)!r}, "
        f"Vidur's {','.join(VIDUR_COLUMNS)!r} or BurstGPT's {','.join(BURSTGPT_HEADER)!r}",
        file=label,
    )
