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
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from contbatch.loop.intake import IntakeError
from contbatch.server.admission import TokenizerPool, check_prompt_size
from contbatch.server.auth import KeyPolicy, request_priority, request_tenant
from contbatch.server.choices import Choices, choice_submissions
from contbatch.server.client import EngineClient, ModelInfo, RequestStream
from contbatch.server.driver import DELIVERY_FAILED, DriverClosed
from contbatch.server.errors import error_response
from contbatch.server.formats import (
    DONE,
    SUCCESS,
    ChoiceResult,
    Echo,
    Renderer,
    ResponseMeta,
    chunk,
    error_for,
    merge_logprobs,
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
from contbatch.server.types import SamplingParams, Submission

log = logging.getLogger(__name__)

# longer prompts are size-checked, then tokenized on the tokenizer pool (a 503 when it is full); shorter
# ones there too while it has spare room (`TokenizerPool.has_spare_room`), else on the event loop
LONG_PROMPT_CHARS = 8192


@dataclass(frozen=True, slots=True)
class ServerConfig:
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    default_max_tokens: int = 1024  # chat requests that give no limit (capped by max_model_len)
    retry_after_s: int = 1  # the Retry-After of a 429
    shutdown_grace_s: float = 5.0  # in-flight requests get this long to finish at shutdown
    body_timeout_s: float | None = 30.0  # a request body not read in full by then: 408, connection closed
    tokenizer_workers: int = 2  # threads that tokenize long prompts (`admission.TokenizerPool`)
    tokenizer_queue: int = 64  # long prompts admitted to them at once (running or queued); more: 503
    trust_tenant_header: bool = False  # honour X-Tenant (else the tenant is the API key's, or none)
    api_keys: Mapping[str, KeyPolicy] | None = None  # key -> policy; None: no key needed (`auth`)


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
    body = await read_json_body(request, config.max_body_bytes, timeout_s=config.body_timeout_s)
    parsed = parse_chat(body) if chat else parse_completion(body)
    info = client.model
    if parsed.model is not None and parsed.model != info.name:
        raise APIError(
            404,
            f"the model '{parsed.model}' does not exist; this server serves '{info.name}'",
            param="model",
            code="model_not_found",
        )
    _refuse_for_backend(parsed, info)
    tenant = request_tenant(request, trust_header=config.trust_tenant_header)  # checked before any work
    priority = request_priority(request, parsed.priority if body.get("priority") is not None else None)
    prompt_ids = await _prompt_ids(client, parsed, request.app.state.tokenizer_pool)
    params = _sampling_params(parsed, _max_tokens(parsed, len(prompt_ids), info, config))
    prefix = "chatcmpl-" if chat else "cmpl-"
    response_id = prefix + uuid.uuid4().hex
    submission = Submission(response_id, prompt_ids, params, arrival_ts, priority=priority, tenant=tenant)
    try:
        choices = Choices.submit(client, choice_submissions(submission, parsed.n))
    except DriverClosed:
        raise APIError(503, "the server is shutting down", code="shutting_down") from None
    try:
        rejected = await choices.first()
    except BaseException:
        choices.abort()
        raise
    if rejected is not None:
        choices.abort()
        error = error_for(rejected, retry_after_s=config.retry_after_s, reject_params=_reject_params(parsed))
        raise error if error is not None else APIError(500, "the request ended before it started")
    meta = ResponseMeta(response_id, int(time.time()), info.name, chat)
    renderers = _renderers(client, parsed, prompt_ids)
    if parsed.stream:
        return SSEResponse(_sse(choices, meta, parsed, config, renderers), on_close=choices.abort)
    return await _collect(request, choices, meta, config, renderers)


def _refuse_for_backend(parsed: GenerationRequest, info: ModelInfo) -> None:
    """400 naming a field the backend cannot honour (an echo of a text prompt needs nothing of it),
    or a logit_bias token id outside the vocabulary."""
    for name in parsed.nondefault():
        reason = info.unsupported.get(name)
        if reason and not (name == "echo" and parsed.prompt_token_ids is None):
            raise bad(f"'{name}' is not supported by the {info.backend} backend: {reason}", name)
    vocab = info.vocab_size
    if parsed.logit_bias and vocab is not None and parsed.logit_bias[-1][0] >= vocab:
        raise bad(f"'logit_bias' names token id {parsed.logit_bias[-1][0]}, outside [0, {vocab})", "logit_bias")


def _sampling_params(parsed: GenerationRequest, max_tokens: int) -> SamplingParams:
    """The request's `SamplingParams` (max_tokens 0 with echo runs one token, which is not shown)."""
    return SamplingParams(
        max_tokens=max(max_tokens, 1),
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        seed=parsed.seed,
        stop=parsed.stop,
        ignore_eos=parsed.ignore_eos,
        top_k=parsed.top_k,
        min_p=parsed.min_p,
        presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty,
        repetition_penalty=parsed.repetition_penalty,
        logit_bias=parsed.logit_bias,
        logprobs=parsed.logprobs,
        prompt_logprobs=parsed.logprobs if parsed.echo else None,
    )


def _hides_output(parsed: GenerationRequest) -> bool:
    return parsed.echo and parsed.max_tokens == 0


def _renderers(client: EngineClient, parsed: GenerationRequest, prompt_ids: tuple[int, ...]) -> list[Renderer]:
    echo = None
    if parsed.echo:
        text = parsed.prompt if parsed.prompt is not None else client.decode(prompt_ids)
        echo = Echo(text, prompt_ids)

    def decode(ids: Sequence[int]) -> str:
        return client.decode(ids, skip_special_tokens=False)

    hide = _hides_output(parsed)
    return [
        Renderer(chat=parsed.chat, decode=decode, num_top=parsed.logprobs, echo=echo, hide_output=hide)
        for _ in range(parsed.n)
    ]


def _reject_params(parsed: GenerationRequest) -> dict[str, str]:
    """Which field a rejection names (the checks of `_max_tokens` catch most before submission)."""
    prompt = "messages" if parsed.chat else "prompt"
    length = parsed.max_tokens_field
    return {"max_model_len": length, "kv_capacity": prompt, "token_budget": prompt, "tenant_quota": length}


async def _prompt_ids(client: EngineClient, parsed: GenerationRequest, pool: TokenizerPool) -> tuple[int, ...]:
    """The prompt's token ids, through the loop's intake (tokenization and checks); a text that
    cannot fit is refused untokenized, a long one is tokenized on the bounded tokenizer pool,
    keeping the event loop serving streams. A tokenizer that raises fails this request alone:
    500 naming the prompt's field (code ``tokenization_failed``)."""
    param = "messages" if parsed.chat else "prompt"
    try:
        return await _tokenize(client, parsed, pool, param)
    except APIError:
        raise
    except Exception as exc:
        log.exception("tokenization failed")
        raise APIError(
            500,
            f"'{param}' could not be tokenized: {type(exc).__name__}: {exc}",
            param=param,
            code="tokenization_failed",
        ) from None


async def _tokenize(
    client: EngineClient, parsed: GenerationRequest, pool: TokenizerPool, param: str
) -> tuple[int, ...]:
    prompt: str | tuple[int, ...]
    if parsed.chat:  # the template's token ids, as transformers' apply_chat_template(tokenize=True) gives them
        if sum(len(m.content) for m in parsed.messages) >= LONG_PROMPT_CHARS:
            check_prompt_size(client, "\n".join(m.content.strip() for m in parsed.messages), param)
            prompt = await pool.run(functools.partial(client.chat_prompt_ids, parsed.messages))
        else:
            prompt = client.chat_prompt_ids(parsed.messages)
    else:
        prompt = parsed.prompt_token_ids if parsed.prompt_token_ids is not None else parsed.prompt or ""
    try:
        if isinstance(prompt, str):
            long = len(prompt) >= LONG_PROMPT_CHARS
            if long:
                check_prompt_size(client, prompt, param)
            if long or pool.has_spare_room:  # (the tokenizer releases the GIL: off the event loop)
                return await pool.run(functools.partial(client.prompt_ids, prompt))
        return client.prompt_ids(prompt)
    except IntakeError as exc:
        raise bad(f"'{param}': {exc}", param) from None


def _max_tokens(parsed: GenerationRequest, num_prompt: int, info: ModelInfo, config: ServerConfig) -> int:
    limit = info.max_model_len
    param = "messages" if parsed.chat else "prompt"
    if limit is not None and num_prompt >= limit:
        raise bad(
            f"this model's maximum context length is {limit} tokens; the prompt alone ('{param}') has {num_prompt}",
            param,
        )
    capacity = info.kv_capacity_tokens
    if capacity is not None and num_prompt >= capacity:
        raise bad(f"the KV cache holds {capacity} tokens; the prompt alone ('{param}') has {num_prompt}", param)
    if parsed.max_tokens is None:
        room = config.default_max_tokens if limit is None else limit - num_prompt
        if capacity is not None:
            room = min(room, capacity - num_prompt)
        return min(config.default_max_tokens, room)
    name = parsed.max_tokens_field
    if limit is not None and num_prompt + parsed.max_tokens > limit:
        raise bad(
            f"this model's maximum context length is {limit} tokens; you asked for {num_prompt + parsed.max_tokens} "
            f"({num_prompt} in the prompt, {parsed.max_tokens} in the completion); lower {name}",
            name,
        )
    if capacity is not None and num_prompt + parsed.max_tokens > capacity:
        raise bad(
            f"the KV cache holds {capacity} tokens; you asked for {num_prompt + parsed.max_tokens} "
            f"({num_prompt} in the prompt, {parsed.max_tokens} in the completion); lower {name}",
            name,
        )
    return parsed.max_tokens


async def _sse(
    stream: RequestStream | Choices,
    meta: ResponseMeta,
    parsed: GenerationRequest,
    config: ServerConfig,
    renderers: Sequence[Renderer] = (),
) -> AsyncIterator[bytes]:
    """The SSE stream of a request's choices (`formats` states the chunks)."""
    choices = stream if isinstance(stream, Choices) else Choices([stream])
    render = list(renderers) or [Renderer(chat=meta.chat, decode=lambda ids: "") for _ in range(len(choices))]
    hide = _hides_output(parsed)
    first = [True] * len(choices)
    try:
        async for index, event in choices.events():
            error = error_for(event, retry_after_s=config.retry_after_s) if event.is_final else None
            text, logprobs = render[index].render(event)
            if text or _has_entries(logprobs) or (event.is_final and error is None):
                reason = SUCCESS.get(event.finish_reason) if event.finish_reason is not None else None
                so_far = usage(event, num_output_tokens=0 if hide else None) if parsed.continuous_usage else None
                yield chunk(meta, text, reason, first=first[index], event_usage=so_far, index=index, logprobs=logprobs)
                first[index] = False
            choices.ack(index, len(event.token_ids))  # the chunk has been handed to the connection
            if error is not None:
                yield sse(error.body())
                yield DONE
                return
        finals = [f for f in choices.finals if f is not None]
        if parsed.include_usage and finals:
            yield usage_chunk(meta, finals, hide_output=hide)
        yield DONE
    except Exception as exc:  # never leave a stream without an end
        log.exception("a stream failed")
        choices.fail(f"{DELIVERY_FAILED}: {type(exc).__name__}: {exc}")  # counted as its delivery's failure
        yield sse(APIError(500, f"the stream failed: {type(exc).__name__}: {exc}").body())
        yield DONE
    finally:
        choices.abort()


def _has_entries(logprobs: dict[str, object] | None) -> bool:
    return logprobs is not None and any(bool(v) for v in logprobs.values())


async def _collect(
    request: Request,
    choices: Choices,
    meta: ResponseMeta,
    config: ServerConfig,
    renderers: Sequence[Renderer],
) -> Response:
    gather = asyncio.ensure_future(_gather(choices, renderers))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gather.done():
            gather.cancel()
        elif not gather.cancelled() and (exc := gather.exception()) is not None:
            choices.fail(f"{DELIVERY_FAILED}: {type(exc).__name__}: {exc}")  # then its 500 (`app._guarded`)
        choices.abort()
    if gather not in done:
        return Response(status_code=499)  # the client left; nobody reads this
    results = gather.result()
    for result in results:
        error = error_for(result.final, retry_after_s=config.retry_after_s)
        if error is not None:
            return error_response(error)
    return JSONResponse(response_body(meta, results, hide_output=renderers[0].hide_output))


async def _gather(choices: Choices, renderers: Sequence[Renderer]) -> list[ChoiceResult]:
    """Every choice's text and logprobs, until each has ended (or one has failed)."""
    parts: list[list[str]] = [[] for _ in range(len(choices))]
    logprobs: list[dict[str, object] | None] = [None] * len(choices)
    async for index, event in choices.events():
        text, found = renderers[index].render(event)
        parts[index].append(text)
        logprobs[index] = merge_logprobs(logprobs[index], found)
        choices.ack(index, len(event.token_ids))
        if event.is_final and error_for(event) is not None:
            return [ChoiceResult(index, "".join(parts[index]), None, event)]  # the response is this error
    return [
        ChoiceResult(i, "".join(parts[i]), logprobs[i], final)
        for i, final in enumerate(choices.finals)
        if final is not None
    ]


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
