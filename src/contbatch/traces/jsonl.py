"""The canonical JSONL trace format: reading and writing.

One JSON object per line::

    {"id": "A", "arrival": 0, "prompt_tokens": 4, "output_tokens": 5}

with optional ``"priority"`` (int, default 0), ``"tenant"`` (string), ``"deadline"`` (absolute,
same clock as ``arrival``), ``"max_tokens"`` (int, the client's output limit), ``"prefix_group"``
(string) with ``"prefix_tokens"`` (int, default 0), ``"cancel_at"`` (absolute, same clock as
``arrival``) and ``"read_rate"`` (tokens per time unit); `contbatch.traces.schema` states what
each means and its rules. ``null`` for an optional key means absent. Blank lines are
skipped; anything else, a comment included, must be a JSON object. Unknown and repeated keys are
errors, so a typo is never silently ignored. The file carries no time unit: the loader's
``time_unit`` says what the numbers mean (seconds by default).

Invariant: ``load_jsonl(write_jsonl(trace))`` gives back ``trace.requests`` exactly (floats are
written with Python's shortest round-tripping repr; optional fields at their defaults are
omitted).
"""

from __future__ import annotations

import json
from typing import Any

from contbatch.traces._common import (
    ATTRIBUTE_TO_FIELD,
    CANONICAL_FIELDS,
    REQUIRED_FIELDS,
    PathArg,
    Where,
    assemble_trace,
    build_request,
    load_file,
    number_value,
)
from contbatch.traces.schema import Trace, TraceError, TraceRequest


def load_jsonl(path: PathArg, *, time_unit: str = "s", name: str | None = None, source: str | None = None) -> Trace:
    """Load a canonical JSONL trace; the name defaults to the file stem."""
    return load_file(parse_jsonl, path, time_unit=time_unit, name=name, source=source, default_source="file {file}")


def parse_jsonl(text: str, label: str, *, name: str, time_unit: str, source: str) -> Trace:
    """Parse JSONL ``text``; ``label`` names the file in error messages."""
    if not text.strip():
        raise TraceError("empty file", file=label)
    located: list[tuple[int, TraceRequest]] = []
    for index, raw_line in enumerate(text.split("\n")):
        line = raw_line.rstrip("\r")
        if line.strip():
            where = Where(label, index + 1)
            located.append((where.line, _request_from_line(line, where)))
    return assemble_trace(label, located, name=name, time_unit=time_unit, source=source)


def _request_from_line(line: str, where: Where) -> TraceRequest:
    obj = _decode_object(line, where)
    if not obj.keys() <= CANONICAL_FIELDS.keys():  # (one set comparison; then the first stranger)
        key = next(key for key in obj if key not in CANONICAL_FIELDS)
        raise where.error(_unknown_key_problem(key), key)
    for key in REQUIRED_FIELDS:
        if obj.get(key) is None:
            raise where.error("missing required field", key)
    values = {CANONICAL_FIELDS[key]: value for key, value in obj.items() if value is not None}
    return build_request(values, where, ATTRIBUTE_TO_FIELD)


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _dict_of_distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return obj


# one decoder for every line (`json.loads` with a hook builds one per call: a fifth of a load)
_DECODER = json.JSONDecoder(object_pairs_hook=_dict_of_distinct_keys)


def _decode_object(line: str, where: Where) -> dict[str, Any]:
    try:
        obj = _DECODER.decode(line)
    except json.JSONDecodeError as exc:
        hint = " (JSONL has no comments)" if line.lstrip().startswith(("#", "//")) else ""
        raise where.error(f"invalid JSON: {exc.msg} at column {exc.colno}{hint}") from None
    except _RepeatedKey as exc:
        raise where.error("key given twice", exc.key) from None
    if not isinstance(obj, dict):
        raise where.error(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _unknown_key_problem(key: str) -> str:
    import difflib  # (only for a bad key: not loaded for every trace)

    close = difflib.get_close_matches(key, CANONICAL_FIELDS, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown key (expected {', '.join(CANONICAL_FIELDS)}){hint}"


def write_jsonl(trace: Trace, path: PathArg) -> None:
    """Write ``trace.requests`` as canonical JSONL (name, unit and source are not stored)."""
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for request in trace.requests:
            handle.write(json.dumps(request_to_json(request)) + "\n")


def request_to_json(request: TraceRequest) -> dict[str, object]:
    """The canonical JSON object of one request, optional fields omitted at their defaults."""
    obj: dict[str, object] = {
        "id": request.request_id,
        "arrival": number_value(request.arrival_ts),
        "prompt_tokens": request.num_prompt_tokens,
        "output_tokens": request.num_output_tokens,
    }
    optional: dict[str, object] = {
        "priority": request.priority or None,
        "tenant": request.tenant,
        "deadline": _maybe_number(request.deadline_ts),
        "max_tokens": request.max_output_tokens,
        "prefix_group": request.prefix_group,
        "prefix_tokens": request.prefix_tokens or None,
        "cancel_at": _maybe_number(request.cancel_ts),
        "read_rate": _maybe_number(request.read_rate),
    }
    obj.update((key, value) for key, value in optional.items() if value is not None)
    return obj


def _maybe_number(value: float | None) -> int | float | None:
    return None if value is None else number_value(value)
