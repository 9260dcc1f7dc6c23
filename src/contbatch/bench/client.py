"""One streaming request to an OpenAI-compatible endpoint, and the client-side record of it.

What is sent (`Target.body`): the OpenAI fields ``model``, ``stream`` (true), ``stream_options``
with ``include_usage``, ``temperature`` (0), and ``prompt`` + ``max_tokens`` (completions) or
``messages`` + ``max_completion_tokens`` (chat). Extensions are sent only when asked, so any
OpenAI-compatible server takes the request (a strict one, such as ``transformers serve``, answers
422 to a field it does not know): ``ignore_eos`` (vLLM: force the output length),
``stream_options.continuous_usage_stats`` (vLLM: usage in every chunk, for exact token counts
per chunk), ``priority`` (vLLM: the trace's priority), and any ``extra_body`` fields. A trace's
tenant goes in the ``X-Tenant`` header (contbatch's; other servers ignore unknown headers).

The record holds what the client observed, on the run's clock (`time.monotonic()` seconds from
the run start): the scheduled send time, the actual send time, each chunk's arrival with its
token count, and the end. `RequestRecord.timeline()` turns it into a
`contbatch.core.timeline.Timeline` whose ARRIVED is the *scheduled* send time (latencies are
measured from when the request should have been sent: no coordinated omission) and whose one
SCHEDULED event is the actual send (so the metrics' queue time is the client's own queue time).

Token counts per chunk: the difference of ``usage.completion_tokens`` between chunks when the
server sends usage in every chunk (``continuous_usage_stats``), else one token per chunk with
text; the last usage the server reports (a usage-only chunk, or the usage of the finishing
chunk) is the request's output length: what it holds beyond the tokens counted goes to the last
chunk with text.

How a request ends, as a finish reason: ``length``/``stop`` from the stream; HTTP 429 is
REJECTED; HTTP 504 or an error chunk of type ``timeout_error`` is TIMEOUT; a client-side
cancellation (the trace's cancel time) is CANCELLED; anything else (another HTTP error, an error
chunk, a broken connection, a stream without a finish) is ERROR.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from contbatch.bench.workload import BenchRequest
from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline

_REASONS = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP}


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    headers: tuple[tuple[str, str], ...] = ()
    ignore_eos: bool = False  # vLLM's ignore_eos: every request runs to its max_tokens
    continuous_usage_stats: bool = False  # vLLM's stream_options.continuous_usage_stats
    send_priority: bool = False  # vLLM's priority, from the trace
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every body, last

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def url(self) -> str:
        return self.root + ("/v1/chat/completions" if self.chat else "/v1/completions")

    @property
    def models_url(self) -> str:
        return self.root + "/v1/models"

    @property
    def extensions(self) -> list[str]:
        """The non-OpenAI request fields this target sends (a priority only for requests that have one)."""
        names = [
            name
            for name, on in (
                ("ignore_eos", self.ignore_eos),
                ("stream_options.continuous_usage_stats", self.continuous_usage_stats),
                ("priority", self.send_priority),
            )
            if on
        ]
        return names + sorted(self.extra_body)

    def body(self, spec: BenchRequest) -> dict[str, Any]:
        stream_options: dict[str, Any] = {"include_usage": True}
        if self.continuous_usage_stats:
            stream_options["continuous_usage_stats"] = True
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": stream_options,
            "temperature": 0.0,
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
            body["max_completion_tokens"] = spec.max_tokens
        else:
            body["prompt"] = spec.prompt
            body["max_tokens"] = spec.max_tokens
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.send_priority and spec.priority:
            body["priority"] = spec.priority
        body.update(self.extra_body)
        return body


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    scheduled_ts: float  # when it should have been sent
    num_prompt_tokens: int  # intended; replaced by the server's usage when it reports one
    max_tokens: int
    priority: int = 0
    tenant: str | None = None
    send_ts: float | None = None  # when it was sent (after any client-side queueing)
    chunk_ts: list[float] = field(default_factory=list)  # arrival of each chunk with text
    chunk_tokens: list[int] = field(default_factory=list)  # tokens of each such chunk
    end_ts: float | None = None
    status: int | None = None  # HTTP status
    finish: FinishReason | None = None
    error: str = ""
    text_chars: int = 0
    usage_completion_tokens: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    def timeline(self) -> Timeline:
        tl = Timeline(
            self.request_id, self.scheduled_ts, self.num_prompt_tokens, tenant=self.tenant, priority=self.priority
        )
        if self.send_ts is not None:
            tl.record_scheduled(max(self.send_ts, self.scheduled_ts))
        for ts, n in zip(self.chunk_ts, self.chunk_tokens, strict=True):
            tl.record_tokens(max(ts, tl.scheduled_ts[-1] if tl.scheduled_ts else ts), n)
        last = max([self.scheduled_ts, *self.chunk_ts, *tl.scheduled_ts])
        end = self.end_ts if self.end_ts is not None else last
        tl.record_finished(max(end, last), self.finish or FinishReason.ERROR)
        return tl


class _Stream:
    """Reads one SSE stream into a record."""

    def __init__(self, record: RequestRecord, clock: Callable[[], float]) -> None:
        self.record = record
        self.clock = clock
        self.seen_tokens = 0  # completion tokens counted so far

    def on_line(self, line: str) -> bool:
        """Handle one line; True at the end of the stream."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        now = self.clock()
        obj = json.loads(data)
        if "error" in obj:
            self._on_error(obj["error"])
            return True
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        if choices:
            self._on_choice(choices[0], usage, now)
        if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
            self.record.num_prompt_tokens = int(usage["prompt_tokens"])
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.record.usage_completion_tokens = int(usage["completion_tokens"])  # the latest is the total
        return False

    def _on_choice(self, choice: dict[str, Any], usage: Any, now: float) -> None:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            total = usage.get("completion_tokens") if isinstance(usage, dict) else None
            n = int(total) - self.seen_tokens if total is not None else 1
            n = max(n, 1)
            self.seen_tokens += n
            self.record.chunk_ts.append(now)
            self.record.chunk_tokens.append(n)
            self.record.text_chars += len(text)
        reason = choice.get("finish_reason")
        if reason:
            self.record.finish = _REASONS.get(reason, FinishReason.STOP)

    def _on_error(self, error: Any) -> None:
        message = error.get("message", "") if isinstance(error, dict) else str(error)
        kind = error.get("type", "") if isinstance(error, dict) else ""
        self.record.finish = FinishReason.TIMEOUT if kind == "timeout_error" else FinishReason.ERROR
        self.record.error = message or "error chunk"

    def close(self) -> None:
        record = self.record
        final = record.usage_completion_tokens
        if final is not None and record.chunk_tokens and final > record.num_output_tokens:
            record.chunk_tokens[-1] += final - record.num_output_tokens
        if record.finish is None:
            record.finish = FinishReason.ERROR
            record.error = record.error or "the stream ended without a finish reason"


def _status_reason(status: int) -> FinishReason:
    if status == 429:
        return FinishReason.REJECTED
    if status == 504:
        return FinishReason.TIMEOUT
    return FinishReason.ERROR


# A request written to a pooled connection that the server closed meanwhile fails before any
# answer (aiohttp: ServerDisconnectedError, or ClientOSError "Can not write request body"): a
# server may close a kept-alive connection right after a response without saying so (llama.cpp's
# server did, a request or two in some runs at Poisson 4/s), and the client cannot see it in
# time. `send` sends such a request once more, on another connection; a second failure is kept.
STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def send(
    http: aiohttp.ClientSession,
    target: Target,
    spec: BenchRequest,
    record: RequestRecord,
    *,
    clock: Callable[[], float],
    cancel_at: float | None = None,
) -> None:
    """Send `spec` now and stream its answer into `record`; never raises (errors are recorded)."""
    headers = dict(target.headers)
    if spec.tenant is not None:
        headers["X-Tenant"] = spec.tenant
    record.send_ts = clock()
    stream = _Stream(record, clock)
    try:
        async with asyncio.timeout(None if cancel_at is None else max(0.0, cancel_at - clock())):
            try:
                await _exchange(http, target, spec, headers, stream)
            except STALE_CONNECTION:
                if record.status is not None:  # an answer had begun: the failure is the request's
                    raise
                await _exchange(http, target, spec, headers, stream)
    except aiohttp.ClientError as exc:  # (first: a connect or read timeout is a ClientError and a TimeoutError)
        _failed(record, exc)
    except TimeoutError:  # the cancel time's, from asyncio.timeout
        record.finish = FinishReason.CANCELLED
        record.error = "cancelled by the client (the trace's cancel time)"
    except (OSError, ValueError) as exc:
        _failed(record, exc)
    record.end_ts = clock()


def _failed(record: RequestRecord, exc: Exception) -> None:
    record.finish = FinishReason.ERROR
    record.error = f"{type(exc).__name__}: {exc}"


async def _exchange(
    http: aiohttp.ClientSession, target: Target, spec: BenchRequest, headers: dict[str, str], stream: _Stream
) -> None:
    record = stream.record
    async with http.post(target.url, json=target.body(spec), headers=headers) as response:
        record.status = response.status
        if response.status != 200:
            raw = await response.read()
            record.finish = _status_reason(response.status)
            record.error = f"HTTP {response.status}: {_error_message(raw)}"
            return
        async for line in lines(response.content.iter_any()):
            if stream.on_line(line):
                break
    stream.close()


async def lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a byte stream, without their ending (\n or \r\n), decoded as UTF-8 (a
    line is whole before it is decoded, so a character split between chunks is too; an invalid
    one raises UnicodeDecodeError, a ValueError); a last line without an ending too."""
    rest = b""
    async for chunk in chunks:
        *complete, rest = (rest + chunk).split(b"\n")
        for line in complete:
            yield line.removesuffix(b"\r").decode()
    if rest:
        yield rest.removesuffix(b"\r").decode()


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")
