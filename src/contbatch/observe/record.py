"""The observation file: what `contbatch observe` saw of a server, one JSON object per line.

Line 1 is the header::

    {"format": "contbatch-observation", "version": 1, "created": ISO 8601 UTC,
     "target": {"url", "model", "chat", "extensions"}, "plan": {...}, "capacity_rps": float | null}

Every further line is one run (`ObservedRun`): ``{"name", "kind", "params", "requests": [...]}``
with each request (`ObservedRequest`) as ``{"id", "scheduled", "send", "prompt", "max_tokens",
"chunk_ts", "chunk_tokens", "end", "finish", "status", "error"}``. Times are seconds on the run's
own clock (`time.monotonic()` minus the run start, as `contbatch.bench.runner` keeps it), so the
runs of one file never share a clock; ``prompt`` is the server's usage count of prompt tokens
(the intended count when the server reported none); ``chunk_tokens`` are the output tokens of
each streamed chunk with text (`contbatch.bench.client` states how they are counted).

Invariants, checked when a file is read (`load_observation`; a bad file raises
`ObservationError` naming the file, the line and the field): ``chunk_ts`` and ``chunk_tokens``
have equal lengths, every chunk carries at least one token, chunk times never decrease and none
precedes the send; ``finish`` is a `FinishReason` value; run names are unique. Writing then
reading a file gives equal objects (`dump_observation` / `load_observation`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contbatch.bench.client import RequestRecord
from contbatch.core.status import FinishReason

OBSERVATION_FORMAT = "contbatch-observation"
OBSERVATION_VERSION = 1
RUN_KINDS = ("warmup", "prefill", "decode", "open")
COMPLETED = (FinishReason.LENGTH, FinishReason.STOP)


class ObservationError(ValueError):
    """An observation file cannot be read; the message names the file, the line and the field."""


@dataclass(frozen=True, slots=True)
class ObservedRequest:
    request_id: str
    scheduled_ts: float  # when the plan meant to send it
    send_ts: float  # when it was sent
    num_prompt_tokens: int  # the server's usage count (else the intended one)
    max_tokens: int
    chunk_ts: tuple[float, ...]  # arrival of each chunk with text
    chunk_tokens: tuple[int, ...]  # output tokens of each such chunk (>= 1)
    end_ts: float
    finish: FinishReason
    status: int | None = None
    error: str = ""

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def completed(self) -> bool:
        """Finished ``length`` or ``stop`` with at least one token: a request the fit can use whole."""
        return self.finish in COMPLETED and bool(self.chunk_ts)

    @classmethod
    def of_record(cls, record: RequestRecord) -> ObservedRequest:
        send = record.send_ts if record.send_ts is not None else record.scheduled_ts
        return cls(
            record.request_id, record.scheduled_ts, send, record.num_prompt_tokens, record.max_tokens,
            tuple(record.chunk_ts), tuple(record.chunk_tokens), record.end_ts if record.end_ts is not None else send,
            record.finish or FinishReason.ERROR, record.status, record.error,
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.request_id, "scheduled": _r(self.scheduled_ts), "send": _r(self.send_ts),
            "prompt": self.num_prompt_tokens, "max_tokens": self.max_tokens,
            "chunk_ts": [_r(t) for t in self.chunk_ts], "chunk_tokens": list(self.chunk_tokens),
            "end": _r(self.end_ts), "finish": self.finish.value, "status": self.status, "error": self.error,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class ObservedRun:
    name: str  # unique in a file, e.g. "decode-n8-p32"
    kind: str  # one of RUN_KINDS
    params: Mapping[str, Any]  # what the plan asked for (concurrency, rate, lengths)
    requests: tuple[ObservedRequest, ...]

    @property
    def completed(self) -> tuple[ObservedRequest, ...]:
        return tuple(r for r in self.requests if r.completed)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "params": dict(self.params),
                "requests": [r.as_dict() for r in self.requests]}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Observation:
    header: Mapping[str, Any]
    runs: tuple[ObservedRun, ...] = field(default_factory=tuple)

    def select(self, kinds: Iterable[str]) -> tuple[ObservedRun, ...]:
        wanted = set(kinds)
        return tuple(run for run in self.runs if run.kind in wanted)


def _r(value: float) -> float:
    return round(value, 6)


def header(
    target: Mapping[str, Any], plan: Mapping[str, Any], capacity_rps: float | None, created: str
) -> dict[str, Any]:
    return {"format": OBSERVATION_FORMAT, "version": OBSERVATION_VERSION, "created": created,
            "target": dict(target), "plan": dict(plan), "capacity_rps": capacity_rps}  # fmt: skip


def dump_observation(observation: Observation, path: str | os.PathLike[str]) -> None:
    lines = [json.dumps(dict(observation.header))] + [json.dumps(run.as_dict()) for run in observation.runs]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def append_run(run: ObservedRun, path: str | os.PathLike[str]) -> None:
    """Add one run to a file whose header is written: a run observed is kept even if a later one fails."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(run.as_dict()) + "\n")


def load_observation(path: str | os.PathLike[str]) -> Observation:
    label = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ObservationError(f"{label}: no such observation file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ObservationError(f"{label}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ObservationError(f"{label}: empty file (expected a contbatch observe header line)")
    head = _json(label, *lines[0])
    if head.get("format") != OBSERVATION_FORMAT or head.get("version") != OBSERVATION_VERSION:
        raise ObservationError(f"{label}:1: not a {OBSERVATION_FORMAT} file of version {OBSERVATION_VERSION}")
    runs = tuple(_run(_json(label, n, line), f"{label}:{n}") for n, line in lines[1:])
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise ObservationError(f"{label}: run names repeat")
    return Observation(head, runs)


def _json(label: str, number: int, line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ObservationError(f"{label}:{number}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ObservationError(f"{label}:{number}: expected a JSON object")
    return value


def _run(obj: Mapping[str, Any], where: str) -> ObservedRun:
    name, kind, params, requests = obj.get("name"), obj.get("kind"), obj.get("params", {}), obj.get("requests")
    if not isinstance(name, str) or not name:
        raise ObservationError(f"{where}: field 'name': must be a non-empty string")
    if kind not in RUN_KINDS:
        raise ObservationError(f"{where}: field 'kind': must be one of {', '.join(RUN_KINDS)}, got {kind!r}")
    if not isinstance(params, dict) or not isinstance(requests, list):
        raise ObservationError(f"{where}: fields 'params' and 'requests' must be an object and a list")
    return ObservedRun(name, kind, params, tuple(_request(r, f"{where}: run {name!r}") for r in requests))


def _request(obj: object, where: str) -> ObservedRequest:
    if not isinstance(obj, dict):
        raise ObservationError(f"{where}: a request must be a JSON object")
    try:
        finish = FinishReason(obj.get("finish"))
        request = ObservedRequest(
            str(obj["id"]), _num(obj["scheduled"]), _num(obj["send"]), int(obj["prompt"]), int(obj["max_tokens"]),
            tuple(_num(t) for t in obj["chunk_ts"]), tuple(int(n) for n in obj["chunk_tokens"]), _num(obj["end"]),
            finish, obj.get("status"), str(obj.get("error", "")),
        )  # fmt: skip
    except KeyError as exc:
        raise ObservationError(f"{where}: request field {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ObservationError(f"{where}: request {obj.get('id')!r}: {exc}") from None
    _check(request, where)
    return request


def _num(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


def _check(request: ObservedRequest, where: str) -> None:
    problem = _problem(request.chunk_ts, request.chunk_tokens, request.send_ts)
    if problem:
        raise ObservationError(f"{where}: request {request.request_id!r}: {problem}")


def _problem(chunk_ts: Sequence[float], chunk_tokens: Sequence[int], send_ts: float) -> str:
    if len(chunk_ts) != len(chunk_tokens):
        return "chunk_ts and chunk_tokens differ in length"
    if any(n < 1 for n in chunk_tokens):
        return "a chunk carries no token"
    if any(b < a for a, b in itertools.pairwise(chunk_ts)) or (chunk_ts and chunk_ts[0] < send_ts):
        return "chunk times decrease or precede the send"
    return ""
