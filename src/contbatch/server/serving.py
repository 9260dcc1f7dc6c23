"""One generation request over HTTP: validate, tokenize, submit, then stream or collect.

The request's arrival time is taken first thing (the driver's clock), so TTFT includes reading
the body, tokenization and the wait for the next step boundary. The response status is decided
when the scheduler has seen the request (its first event, at most one step later): rejected
requests get their 429 or 400 before any byte of a stream is sent.

Lifecycle: a streaming client that disconnects has its request aborted (cancelled at the next
step boundary, its KV freed in that step); so does a non-streaming one, watched while it waits.
The SSE writer acknowledges tokens as it hands them to the connection, so a client that stops
reading stops acknowledging and, with output credits configured, its request is paused instead
of buffered without bound.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from contbatch.loop.intake import IntakeError
from contbatch.server.client import EngineClient, ModelInfo, RequestStream
from contbatch.server.driver import DriverClosed
from contbatch.server.formats import (
    DONE,
    SUCCESS,
    ResponseMeta,
    chunk,
    error_for,
    response_body,
    sse,
    usage,
    usage_chunk,
)
from contbatch.server.protocol import (
    APIError,
    GenerationRequest,
    bad,
    parse_chat,
    parse_completion,
    read_json_body,
)
from contbatch.server.types import RequestEvent, SamplingParams, Submission

TENANT_HEADER = "x-tenant"
LONG_PROMPT_CHARS = 32_768  # longer prompts are tokenized on a worker thread
_TENANT = re.compile(r"[A-Za-z0-9._:@/+-]{1,128}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    default_max_tokens: int = 1024  # chat requests that give no limit (capped by max_model_len)
    retry_after_s: int = 1  # the Retry-After of a 429
    shutdown_grace_s: float = 5.0  # in-flight requests get this long to finish at shutdown


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, disconnect, error)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def generate(request: Request, *, chat: bool) -> Response:
    client: EngineClient = request.app.state.client
    config: ServerConfig = request.app.state.config
    arrival_ts = client.now()
    body = await read_json_body(request, config.max_body_bytes)
    parsed = parse_chat(body) if chat else parse_completion(body)
    info = client.model
    if parsed.model is not None and parsed.model != info.name:
        raise APIError(
            404,
            f"the model '{parsed.model}' does not exist; this server serves '{info.name}'",
            param="model",
            code="model_not_found",
        )
    prompt_ids = await _prompt_ids(client, parsed)
    params = SamplingParams(
        max_tokens=_max_tokens(parsed, len(prompt_ids), info, config),
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        seed=parsed.seed,
        stop=parsed.stop,
        ignore_eos=parsed.ignore_eos,
    )
    prefix = "chatcmpl-" if chat else "cmpl-"
    response_id = prefix + uuid.uuid4().hex
    tenant = _tenant(request.headers.get(TENANT_HEADER))
    submission = Submission(response_id, prompt_ids, params, arrival_ts, priority=parsed.priority, tenant=tenant)
    try:
        stream = client.generate(submission)
    except DriverClosed:
        raise APIError(503, "the server is shutting down", code="shutting_down") from None
    try:
        first = await stream.first()
    except BaseException:
        stream.abort()
        raise
    if first.is_final:
        error = error_for(first, retry_after_s=config.retry_after_s)
        raise error if error is not None else APIError(500, "the request ended before it started")
    meta = ResponseMeta(response_id, int(time.time()), info.name, chat)
    if parsed.stream:
        return SSEResponse(_sse(stream, meta, parsed, config), on_close=stream.abort)
    return await _collect(request, stream, meta, config)


async def _prompt_ids(client: EngineClient, parsed: GenerationRequest) -> tuple[int, ...]:
    """The prompt's token ids, through the loop's intake (tokenization and checks); a long text is
    tokenized on a worker thread, keeping the event loop serving streams."""
    param = "messages" if parsed.chat else "prompt"
    prompt: str | tuple[int, ...]
    if parsed.chat:
        prompt = client.chat_prompt(parsed.messages)
    else:
        prompt = parsed.prompt_token_ids if parsed.prompt_token_ids is not None else parsed.prompt or ""
    try:
        if isinstance(prompt, str) and len(prompt) >= LONG_PROMPT_CHARS:
            return await asyncio.to_thread(client.prompt_ids, prompt)
        return client.prompt_ids(prompt)
    except IntakeError as exc:
        raise bad(f"'{param}': {exc}", param) from None


def _max_tokens(parsed: GenerationRequest, num_prompt: int, info: ModelInfo, config: ServerConfig) -> int:
    limit = info.max_model_len
    param = "messages" if parsed.chat else "prompt"
    if limit is not None and num_prompt >= limit:
        raise bad(f"this model's maximum context length is {limit} tokens; the prompt alone has {num_prompt}", param)
    if parsed.max_tokens is None:
        room = config.default_max_tokens if limit is None else limit - num_prompt
        return min(config.default_max_tokens, room)
    if limit is not None and num_prompt + parsed.max_tokens > limit:
        name = "max_completion_tokens" if parsed.chat else "max_tokens"
        raise bad(
            f"this model's maximum context length is {limit} tokens; you asked for {num_prompt + parsed.max_tokens} "
            f"({num_prompt} in the prompt, {parsed.max_tokens} in the completion); lower {name}",
            name,
        )
    return parsed.max_tokens


def _tenant(value: str | None) -> str | None:
    if value is None:
        return None
    if not _TENANT.fullmatch(value):
        raise bad("the X-Tenant header must be 1 to 128 characters of letters, digits and ._:@/+-", "X-Tenant")
    return value


async def _sse(
    stream: RequestStream, meta: ResponseMeta, parsed: GenerationRequest, config: ServerConfig
) -> AsyncIterator[bytes]:
    first = True
    try:
        async for event in stream:
            error = error_for(event, retry_after_s=config.retry_after_s) if event.is_final else None
            if event.text or (event.is_final and error is None):
                reason = SUCCESS.get(event.finish_reason) if event.finish_reason is not None else None
                so_far = usage(event) if parsed.continuous_usage else None
                yield chunk(meta, event.text, reason, first=first, event_usage=so_far)
                first = False
            stream.ack(len(event.token_ids))  # the chunk has been handed to the connection
            if error is not None:
                yield sse(error.body())
                yield DONE
                return
        if parsed.include_usage and stream.final is not None:
            yield usage_chunk(meta, stream.final)
        yield DONE
    except Exception as exc:  # never leave a stream without an end
        yield sse(APIError(500, f"the stream failed: {type(exc).__name__}: {exc}").body())
        yield DONE
    finally:
        stream.abort()


async def _collect(request: Request, stream: RequestStream, meta: ResponseMeta, config: ServerConfig) -> Response:
    gather = asyncio.ensure_future(_gather(stream))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gather.done():
            gather.cancel()
        stream.abort()
    if gather not in done:
        return Response(status_code=499)  # the client left; nobody reads this
    text, final = gather.result()
    error = error_for(final, retry_after_s=config.retry_after_s)
    if error is not None:
        return error_response(error)
    return JSONResponse(response_body(meta, text, final))


async def _gather(stream: RequestStream) -> tuple[str, RequestEvent]:
    parts: list[str] = []
    async for event in stream:
        parts.append(event.text)
        stream.ack(len(event.token_ids))
    assert stream.final is not None
    return "".join(parts), stream.final


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
