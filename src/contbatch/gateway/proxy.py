"""One generation request through the gateway: choose a backend, forward, relay, retry, cancel.

`ProxyCall` is the ASGI response of ``POST /v1/completions`` and ``/v1/chat/completions``. The
body goes to the backend byte for byte (with the gateway's upstream key, the request's tenant in
``X-Tenant`` and its id in ``X-Request-Id``). Then:

- **Retries.** An attempt that fails before any byte reached the client (the backend refuses
  the connection, resets it, times out connecting, answers 502 or 503, or breaks off before its
  first event) is counted (`GatewayMetrics`), taken off the tracker, and the router chooses again
  among the backends not tried yet, at most `retries` times. The client never sees a failed
  attempt. A connection failure also takes the backend out of the rotation until its health
  check passes (`Monitor.failed`).
- **Streams.** The client's response starts with the backend's first complete SSE event (so a
  backend that fails before it is still retried), and events are relayed whole as they come. A
  backend that fails after that (its connection breaks, or its stream ends without ``[DONE]``)
  ends the client's stream cleanly: one ``data: {"error": ...}`` event (type ``server_error``,
  code ``upstream_error``), then ``data: [DONE]``. Each event with output feeds the tracker:
  the first `first_token`, the later ones `tokens` (counted from ``usage.completion_tokens``
  when the backend sends usage in every chunk, else one per chunk with text).
- **Other answers.** A non-streaming answer, or an error status, is relayed whole (status, body,
  ``Content-Type``, ``Retry-After``); if the backend breaks off while it is read and no retry is
  left, the client gets 502 JSON. With the gateway's own keys or an upstream key configured, a
  backend's 401 or 403 is the gateway's misconfiguration, not the client's: 502.
- **Cancellation.** A client that disconnects (watched from the start, through every attempt)
  has its attempt cancelled: the upstream response is closed, which closes its connection, and
  the backend's own disconnect handling cancels the request (``contbatch serve`` frees its KV
  at the next step).

However it ends, the request leaves the tracker (`LoadTracker.finished`) once per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from contbatch.gateway.balancer import Balancer
from contbatch.gateway.config import GatewayConfig
from contbatch.gateway.metrics import GatewayMetrics
from contbatch.gateway.monitor import Monitor
from contbatch.routing import RouteRequest
from contbatch.server.formats import DONE, sse
from contbatch.server.protocol import APIError

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503})
RELAYED_HEADERS = ("content-type", "retry-after")
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
UPSTREAM_ERROR = "upstream_error"


@dataclass(slots=True)
class Gateway:
    """What every request shares: the configuration, the routing state, the metrics, the monitor
    and one HTTP client (a connection pool per backend)."""

    config: GatewayConfig
    balancer: Balancer
    metrics: GatewayMetrics
    monitor: Monitor
    http: httpx.AsyncClient
    upstream_headers: dict[str, str]  # sent on every upstream request (the upstream key)

    def url(self, backend: str) -> str:
        return self.monitor.urls[backend]

    @property
    def owns_auth(self) -> bool:
        """The gateway authenticates on its own (a backend's 401 is then not the client's fault)."""
        return bool(self.config.api_keys) or self.config.upstream_api_key is not None


class _Failed(Exception):
    """An attempt failed; `answer` is the backend's own (status, headers, body) when it gave one."""

    def __init__(
        self,
        stage: str,
        message: str,
        *,
        connection: bool,
        answer: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message
        self.connection = connection  # the connection itself failed (the backend may be down)
        self.answer = answer


class _ClientGone(Exception):
    """Sending to the client failed: it has left."""


class _Relay:
    """The client's side of the exchange: whether its response has started, and how to end it."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.ended = False

    async def _out(self, message: Message) -> None:
        try:
            await self._send(message)
        except OSError as exc:  # (uvicorn's ClientDisconnected is one)
            raise _ClientGone from exc

    async def events(self, body: bytes) -> None:
        if not self.started:
            self.started = True
            await self._out({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await self._out({"type": "http.response.body", "body": body, "more_body": True})

    async def end(self) -> None:
        self.ended = True
        await self._out({"type": "http.response.body", "body": b"", "more_body": False})

    async def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.started = self.ended = True
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await self._out({"type": "http.response.start", "status": status, "headers": headers})
        await self._out({"type": "http.response.body", "body": body, "more_body": False})

    async def error(self, error: APIError) -> None:
        """The error as JSON when nothing was sent yet, else as the stream's last event."""
        if self.ended:
            return
        if not self.started:
            body = json.dumps(error.body()).encode()
            headers = [(b"content-type", b"application/json")]
            headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
            await self.whole(error.status, headers, body)
            return
        await self.events(sse(error.body()) + DONE)
        await self.end()


def _relayed(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), headers[name].encode("latin-1")) for name in RELAYED_HEADERS if name in headers]


class _Events:
    """Splits a byte stream into whole SSE events (CRLF and CR line ends taken as LF)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The events `data` completes, each without its blank-line terminator."""
        raw = self._buffer + data
        held = b""
        if raw.endswith(b"\r"):  # maybe half of a CRLF
            raw, held = raw[:-1], b"\r"
        if b"\r" in raw:
            raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, rest = raw.split(b"\n\n")
        self._buffer = rest + held
        return events


def event_data(event: bytes) -> str | None:
    """The data of one SSE event (its ``data:`` lines joined), None without any."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(lines).decode("utf-8", "replace")


class _TokenCount:
    """Feeds the tracker from the events of one attempt's stream."""

    def __init__(self, balancer: Balancer, request_id: str) -> None:
        self.balancer = balancer
        self.request_id = request_id
        self.first = False
        self.counted = 0  # completion tokens counted so far

    def on_data(self, data: str) -> None:
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict) or "error" in chunk:
            return
        outputs = sum(1 for c in chunk.get("choices") or () if _has_output(c))
        if not outputs:
            return
        usage = chunk.get("usage")
        total = usage.get("completion_tokens") if isinstance(usage, dict) else None
        n = total - self.counted if isinstance(total, int) and not isinstance(total, bool) else outputs
        n = max(n, 1)
        self.counted += n
        if not self.first:
            self.first = True
            self.balancer.first_token(self.request_id)
            n -= 1
        if n:
            self.balancer.tokens(self.request_id, n)


def _has_output(choice: object) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role")


class ProxyCall(Response):
    """The ASGI response of one generation request (module docstring). A `Response` to the
    framework, but it sends its own status and headers when it knows them."""

    def __init__(
        self, gateway: Gateway, path: str, body: bytes, route: RouteRequest, headers: Mapping[str, str], *, stream: bool
    ) -> None:
        self.background: BackgroundTask | None = None
        self.status_code = 200
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.gateway = gateway
        self.path = path
        self.payload = body
        self.route = route
        self.forwarded = {**gateway.upstream_headers, **headers, "x-request-id": route.request_id}
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self._serve(_Relay(send)))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():  # the client left (or the server is stopping): cancel upstream
                if gone.done():
                    self.gateway.metrics.disconnects.inc()
                work.cancel()
            gone.cancel()
            for task in (work, gone):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _serve(self, relay: _Relay) -> None:
        gateway, rid = self.gateway, self.route.request_id
        metrics = gateway.metrics
        tried: list[str] = []
        failure: _Failed | None = None
        try:
            while True:
                backend = gateway.balancer.route(self.route, exclude=tried)
                if backend is None:
                    break
                tried.append(backend)
                metrics.routed.labels(backend).inc()
                try:
                    await self._attempt(backend, relay)
                    return
                except _Failed as failed:
                    failure = failed
                    metrics.upstream_errors.labels(backend, failed.stage).inc()
                    if failed.connection:
                        gateway.monitor.failed(backend)
                    log.warning("backend %s failed request %s (%s): %s", backend, rid, failed.stage, failed.message)
                    if relay.started or len(tried) > gateway.config.retries:
                        break
                    metrics.retries.labels(backend).inc()
                finally:
                    gateway.balancer.finished(rid)
            await self._give_up(relay, tried, failure)
        except _ClientGone:
            metrics.disconnects.inc()
        except Exception as exc:  # never leave a client without an answer
            log.exception("request %s failed in the gateway", rid)
            with contextlib.suppress(_ClientGone):
                await relay.error(APIError(500, f"the gateway failed: {type(exc).__name__}: {exc}"))

    async def _give_up(self, relay: _Relay, tried: list[str], failure: _Failed | None) -> None:
        if failure is None:
            error = APIError(503, "no backend is in the rotation (all failed their health checks)",
                             code="no_backend", headers={"Retry-After": "1"})  # fmt: skip
        elif failure.answer is not None and not relay.started:  # the last backend's own answer
            status, headers, body = failure.answer
            await relay.whole(status, headers, body)
            return
        elif relay.started:
            error = APIError(502, f"the backend failed mid-stream: {failure.message}", code=UPSTREAM_ERROR)
        else:
            error = APIError(502, f"{len(tried)} backend(s) tried, each failed; the last: {failure.message}",
                             code=UPSTREAM_ERROR)  # fmt: skip
        await relay.error(error)

    async def _attempt(self, backend: str, relay: _Relay) -> None:
        gateway = self.gateway
        request = gateway.http.build_request("POST", gateway.url(backend) + self.path, content=self.payload,
                                             headers=self.forwarded)  # fmt: skip
        try:
            response = await gateway.http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            connecting = isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
            raise _Failed("connect", f"no answer in time ({type(exc).__name__})", connection=connecting) from None
        except (httpx.HTTPError, OSError) as exc:
            raise _Failed("connect", f"{type(exc).__name__}: {exc}", connection=True) from None
        try:
            await self._answer(response, relay)
        finally:
            await response.aclose()

    async def _answer(self, response: httpx.Response, relay: _Relay) -> None:
        status = response.status_code
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        if status == 200 and self.stream and streamed:
            await self._relay_stream(response, relay)
            return
        body = await _read(response)
        answer = (status, _relayed(response.headers), body)
        if status in RETRY_STATUSES:
            raise _Failed("status", f"it answered {status}", connection=False, answer=answer)
        if status in (401, 403) and self.gateway.owns_auth:
            await relay.error(APIError(502, f"the backend refused the gateway's credentials ({status})",
                                       code=UPSTREAM_ERROR))  # fmt: skip
            return
        await relay.whole(*answer)

    async def _relay_stream(self, response: httpx.Response, relay: _Relay) -> None:
        parser, count = _Events(), _TokenCount(self.gateway.balancer, self.route.request_id)
        chunks = response.aiter_bytes()
        while True:
            try:
                data = await anext(chunks)
            except StopAsyncIteration:
                break
            except (httpx.HTTPError, OSError) as exc:
                raise _broken(exc) from None
            events = parser.feed(data)
            if not events:
                continue
            done = False
            for event in events:
                text = event_data(event)
                if text == "[DONE]":
                    done = True
                    self.gateway.balancer.finished(self.route.request_id)  # it has left the backend: now
                elif text is not None:
                    count.on_data(text)
            await relay.events(b"".join(e + b"\n\n" for e in events))
            if done:
                await relay.end()
                await _drain(chunks)
                return
        raise _Failed("body", "its stream ended without [DONE]", connection=False)


def _broken(exc: Exception) -> _Failed:
    if isinstance(exc, httpx.TimeoutException):
        return _Failed("body", f"it sent nothing for too long ({type(exc).__name__})", connection=False)
    return _Failed("body", f"its answer broke off ({type(exc).__name__}: {exc})", connection=True)


async def _drain(chunks: AsyncIterator[bytes], limit: int = 1 << 16) -> None:
    """Read what follows ``[DONE]`` (the body's end) so that the connection goes back to the pool;
    a backend that keeps sending has its connection closed instead."""
    size = 0
    with contextlib.suppress(httpx.HTTPError, OSError, TimeoutError):
        async with asyncio.timeout(1.0):
            async for data in chunks:
                size += len(data)
                if size > limit:
                    return


async def _read(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    except (httpx.HTTPError, OSError) as exc:
        raise _broken(exc) from None


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (its body was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
