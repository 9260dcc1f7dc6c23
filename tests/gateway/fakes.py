"""A minimal OpenAI-compatible backend whose health, metrics and failures a test sets.

`FakeBackend.mode`:
- ``ok``: a completion of `num_tokens` chunks (streamed, or one body);
- ``break_before_first``: a stream that answers 200, then drops the connection before any event;
- ``break_after:K``: a stream that drops the connection after K events;
- ``status:CODE``: answers CODE with an OpenAI error body.
It records every generation request it gets (headers and body)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


class Dropped(Exception):
    """Raised inside a stream: uvicorn then closes the connection mid-body."""


@dataclass
class FakeBackend:
    name: str = "fake"
    healthy: bool = True
    mode: str = "ok"
    num_tokens: int = 4
    metrics_text: str | None = None  # None: /metrics answers 404
    seen: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health, methods=["GET", "HEAD"]),
                Route("/metrics", self._metrics),
                Route("/v1/models", self._models),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
            ]
        )

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok" if self.healthy else "down"}, status_code=200 if self.healthy else 503)

    async def _metrics(self, request: Request) -> Response:
        if self.metrics_text is None:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(self.metrics_text)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def _generate(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.seen.append({"headers": dict(request.headers), "body": body})
        if self.mode.startswith("status:"):
            status = int(self.mode.split(":")[1])
            error = {"error": {"message": f"{self.name} says {status}", "type": "server_error", "param": None,
                               "code": None}}  # fmt: skip
            return JSONResponse(error, status_code=status, headers={"Retry-After": "3"})
        if not body.get("stream"):
            text = " x" * self.num_tokens
            return JSONResponse({"object": "text_completion", "model": self.name,
                                 "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})  # fmt: skip
        return StreamingResponse(self._events(), media_type="text/event-stream")

    async def _events(self) -> AsyncIterator[bytes]:
        if self.mode == "break_before_first":
            raise Dropped("dropped before the first event")
        cut = int(self.mode.split(":")[1]) if self.mode.startswith("break_after:") else None
        for i in range(self.num_tokens):
            if cut is not None and i == cut:
                raise Dropped(f"dropped after {cut} events")
            reason = "length" if i == self.num_tokens - 1 else None
            chunk = {"object": "text_completion", "model": self.name,
                     "choices": [{"index": 0, "text": " x", "finish_reason": reason}]}  # fmt: skip
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await asyncio.sleep(0.01)
        yield b"data: [DONE]\n\n"
