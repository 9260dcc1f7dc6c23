"""contbatch.traces: the canonical trace schema and its loaders (standard library only).

A trace is an ordered list of requests, each with an arrival offset, a prompt length and a
forced output length, and optionally a priority, tenant, deadline, output limit, shared prefix,
cancel time and client read rate (`TraceRequest`, `Trace`; `contbatch.traces.schema` states the
rules). It can come from

- a built-in: ``seed`` (the specification's worked example, in ticks), ``azure-code`` (the
  shipped Azure LLM inference trace 2023, code service, in seconds; see ``data/README.md``), or
  one of the seeded synthetic scenarios of `contbatch.traces.scenarios` (``kv-pressure``,
  ``long-prompt``, ... in seconds);
- canonical JSONL (`load_jsonl`, written by `write_jsonl`) or canonical CSV (`load_csv`, written
  by `write_csv`);
- the Azure LLM inference trace CSV format (`import_azure_csv`), Vidur's trace-replay CSV
  (`import_vidur_csv`) and the BurstGPT CSV (`import_burstgpt_csv`);
- `contbatch.traces.synthetic`: seeded arrival processes and length distributions, `generate`,
  and `scale_to_rate` to replay any trace at another mean rate.

`load_trace` picks among them from a name or a path. Every loading problem is a `TraceError`
whose message names the file, and for a row the line and the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contbatch.lazy import lazy_names
from contbatch.traces.schema import Trace, TraceError, TraceRequest

if TYPE_CHECKING:
    from contbatch.traces.azure import import_azure_csv
    from contbatch.traces.burstgpt import import_burstgpt_csv
    from contbatch.traces.canonical_csv import load_csv, write_csv
    from contbatch.traces.jsonl import load_jsonl, write_jsonl
    from contbatch.traces.registry import builtin_trace_names, load_trace
    from contbatch.traces.vidur import import_vidur_csv

# the loaders, imported on first use: a run of a generated trace needs none of them
_LAZY = {
    "import_azure_csv": "azure",
    "import_burstgpt_csv": "burstgpt",
    "load_csv": "canonical_csv",
    "write_csv": "canonical_csv",
    "load_jsonl": "jsonl",
    "write_jsonl": "jsonl",
    "builtin_trace_names": "registry",
    "load_trace": "registry",
    "import_vidur_csv": "vidur",
}


__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "Trace",
    "TraceError",
    "TraceRequest",
    "builtin_trace_names",
    "import_azure_csv",
    "import_burstgpt_csv",
    "import_vidur_csv",
    "load_csv",
    "load_jsonl",
    "load_trace",
    "write_csv",
    "write_jsonl",
]
