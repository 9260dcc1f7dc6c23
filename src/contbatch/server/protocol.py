"""The OpenAI request bodies: reading, validating, and the error a bad one gets.

Everything a client can get wrong is answered here with an `APIError`: an HTTP status and the
OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}`` whose message and
``param`` name the field. Bodies larger than the limit get 413, bodies that are not UTF-8 or not
a JSON object 400. Unknown fields are ignored (as vLLM does); known features this server does
not have are refused with 400 when a request asks for them, rather than silently dropped:
OpenAI's best_of > 1, suffix, tools, functions, a tool_choice or function_call other than
"none"/"auto", audio output, web search, echo on chat, non-text response formats or content
parts, and vLLM's extensions that change the output (`NOT_IMPLEMENTED`); so are fields a
backend cannot honour (`ModelInfo.unsupported`: the sim backend has no model, hence no logprobs
or penalties).

Defaults: ``max_tokens`` is 16 for completions (OpenAI's); for chat, absent, the server's
default (or what the context leaves); ``max_completion_tokens`` wins over ``max_tokens``;
``max_tokens`` 0 only with ``echo`` (the prompt alone comes back). ``temperature`` in [0, 2],
``top_p`` in (0, 1], ``presence_penalty``/``frequency_penalty`` in [-2, 2],
``repetition_penalty`` in [0.01, 100], ``top_k`` -1, 0 (both off) or >= 1, ``min_p`` in [0, 1],
``logit_bias`` an object of token id (a decimal string) -> bias in [-100, 100], ``seed`` any
64-bit integer ([-2^63, 2^64 - 1]), ``n`` 1 to 128 choices, ``logprobs`` 0 to 20 (completions:
an integer; chat: true, with ``top_logprobs`` 0 to 20), ``stop`` a string or up to 16 strings
of at most 256 characters each (the stop check's cost per token grows with their length),
``logit_bias`` at most 300 entries (a bound on what one request adds to each step), ``priority``
an integer (lower runs first with a priority queue order). The sampling rules are
`contbatch.loop.params`'.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from contbatch.loop.params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
)
from contbatch.server.backends.base import ChatMessage

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # characters per stop string
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_INT = (1 << 31) - 1
MAX_N = 128  # choices per request at most
LARGE_BODY_BYTES = 256 << 10  # larger request bodies are parsed on a worker thread
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An HTTP error answered as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str | None
    prompt: str | None  # completions: the text (None when given as token ids)
    prompt_token_ids: tuple[int, ...] | None  # completions: the prompt as token ids
    messages: tuple[ChatMessage, ...]  # chat
    max_tokens: int | None  # None: the server decides
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool  # stream: a final chunk with usage and no choices
    continuous_usage: bool  # stream: usage in every chunk
    priority: int
    n: int = 1  # choices
    echo: bool = False  # completions: the prompt comes back before the output
    logprobs: int | None = None  # None: none; k: each output token's logprob and the k most likely
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    max_tokens_field: str = "max_tokens"  # the field max_tokens came from (chat: or max_completion_tokens)

    def nondefault(self) -> list[str]:
        """The names of the request's fields (as the client spells them) whose values ask a
        backend for something: what a backend that cannot honour a field refuses."""
        asked = {
            "n": self.n != 1,
            "logprobs": self.logprobs is not None,
            "echo": self.echo,
            "top_k": self.top_k > 0,
            "min_p": self.min_p > 0,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "repetition_penalty": self.repetition_penalty != 1,
            "logit_bias": bool(self.logit_bias),
        }
        return [name for name, on in asked.items() if on]


# -- the body ---------------------------------------------------------------------------------
async def read_json_body(request: Request, limit: int, *, timeout_s: float | None = None) -> dict[str, Any]:
    """The body as a JSON object; 413 beyond `limit` bytes, 408 (and the connection closed) when
    it has not arrived in full within `timeout_s` seconds (a slow-loris client), 400 unless UTF-8
    JSON of an object. A large body is parsed on a worker thread (the event loop keeps serving)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    try:
        async with asyncio.timeout(timeout_s):
            raw = await _read_body(request, limit)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive in full within {timeout_s:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    if len(raw) >= LARGE_BODY_BYTES:
        return await asyncio.to_thread(parse_json_object, raw)
    return parse_json_object(raw)


async def _read_body(request: Request, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad("the request body is empty: expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise bad(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}")
    return body


# -- field readers --------------------------------------------------------------------------------
def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _preview(value: object) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def get_int(
    body: Mapping[str, Any], name: str, *, default: int | None, minimum: int = -MAX_INT, maximum: int = MAX_INT
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {_kind(value)}", name)
    if not minimum <= value <= maximum:
        raise bad(f"'{name}' must be an integer from {minimum} to {maximum}, got {value}", name)
    return value


def get_number(
    body: Mapping[str, Any], name: str, *, default: float, lo: float, hi: float, open_lo: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, got {_kind(value)}", name)
    if value > hi or value < lo or (open_lo and value == lo):
        interval = f"{'(' if open_lo else '['}{lo:g}, {hi:g}]"
        raise bad(f"'{name}' must be in {interval}, got {value:g}", name)
    return float(value)


def get_bool(body: Mapping[str, Any], name: str, *, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {_kind(value)}", name)
    return value


def check_text(value: object, name: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise bad(f"'{name}' must be a string, got {_kind(value)}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"'{name}' holds an invalid unicode character (a lone surrogate)", name) from None
    if not allow_empty and not value:
        raise bad(f"'{name}' must not be empty", name)
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise bad(f"'stop' must be a string or an array of strings, got {_kind(value)}", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad(f"'stop' holds {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    stops = tuple(check_text(s, "stop", allow_empty=False) for s in items)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        longest = max(len(s) for s in stops)
        raise bad(f"'stop' strings may have at most {MAX_STOP_CHARS} characters, got one of {longest}", "stop")
    return stops


def _off(value: object) -> bool:
    """Whether a field's value asks for nothing (absent, null, false, 0, empty)."""
    return value is None or value is False or value == 0 or value in ("", [], {})


# Fields of OpenAI's and vLLM's APIs this server does not implement: refused (400 naming them)
# when their value asks for something (`asks(value)`), accepted when it asks for nothing.
NOT_IMPLEMENTED: dict[str, Callable[[object], bool]] = {
    "suffix": lambda v: not _off(v),
    "tools": lambda v: not _off(v),
    "functions": lambda v: not _off(v),
    "tool_choice": lambda v: v not in (None, "none", "auto"),  # no tools: "none" and "auto" call none
    "function_call": lambda v: v not in (None, "none", "auto"),
    "modalities": lambda v: v is not None and v != ["text"],
    "audio": lambda v: v is not None,
    "web_search_options": lambda v: v is not None,
    # vLLM's extensions that change the output
    "min_tokens": lambda v: not _off(v),
    "stop_token_ids": lambda v: not _off(v),
    "include_stop_str_in_output": lambda v: not _off(v),
    "skip_special_tokens": lambda v: v is not None and v is not True,
    "use_beam_search": lambda v: not _off(v),
    "prompt_logprobs": lambda v: v is not None,
    "allowed_token_ids": lambda v: v is not None,
    "bad_words": lambda v: not _off(v),
    "guided_json": lambda v: v is not None,
    "guided_regex": lambda v: v is not None,
    "guided_choice": lambda v: v is not None,
    "guided_grammar": lambda v: v is not None,
    "structured_outputs": lambda v: v is not None,
}


def _refuse_unsupported(body: Mapping[str, Any], *, chat: bool) -> None:
    """400 for features this server does not have, when asked for with a non-default value."""
    best_of = get_int(body, "best_of", default=1, minimum=1)
    if best_of != 1:
        raise bad(f"'best_of' = {best_of} is not supported: ask for 'n' choices (all are returned)", "best_of")
    if chat and get_bool(body, "echo", default=False):
        raise bad("'echo' is a /v1/completions parameter; chat completions do not echo", "echo")
    if not chat and body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' is a chat parameter; on /v1/completions 'logprobs' is the number", "top_logprobs")
    for name, asks in NOT_IMPLEMENTED.items():
        value = body.get(name)
        if value is not None and asks(value):
            raise bad(f"'{name}' is not supported by this server (got {_preview(value)})", name)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad('\'response_format\' is not supported (only {"type": "text"})', "response_format")
    if body.get("user") is not None:
        check_text(body["user"], "user")


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad(f"'logit_bias' must be an object of token id -> bias, got {_kind(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        limit = MAX_LOGIT_BIAS_ENTRIES
        raise bad(f"'logit_bias' holds {len(value)} entries; at most {limit} are allowed", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) > MAX_INT:
            raise bad(f"'logit_bias' keys must be token ids (decimal integers), got {key[:40]!r}", "logit_bias")
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not number or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for token {key}", "logit_bias")
        pairs.append((int(key), float(bias)))
    if len({t for t, _ in pairs}) != len(pairs):
        raise bad("'logit_bias' names a token id twice", "logit_bias")
    return tuple(sorted(pairs))


def _logprobs(body: Mapping[str, Any], *, chat: bool) -> int | None:
    """Completions: `logprobs` k; chat: `logprobs` true with `top_logprobs` k (default 0)."""
    if not chat:
        return get_int(body, "logprobs", default=None, minimum=0, maximum=MAX_LOGPROBS)
    wanted = get_bool(body, "logprobs", default=False)
    top = get_int(body, "top_logprobs", default=None, minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and not wanted:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _sampling(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    """The fields beyond the basics: choices, logprobs, echo and the logits processing."""
    rep_lo, rep_hi = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
    return {
        "n": get_int(body, "n", default=1, minimum=1, maximum=MAX_N),
        "echo": False if chat else get_bool(body, "echo", default=False),
        "logprobs": _logprobs(body, chat=chat),
        "top_k": get_int(body, "top_k", default=-1, minimum=-1),
        "min_p": get_number(body, "min_p", default=0.0, lo=0.0, hi=1.0),
        "presence_penalty": get_number(body, "presence_penalty", default=0.0, lo=-2.0, hi=2.0),
        "frequency_penalty": get_number(body, "frequency_penalty", default=0.0, lo=-2.0, hi=2.0),
        "repetition_penalty": get_number(body, "repetition_penalty", default=1.0, lo=rep_lo, hi=rep_hi),
        "logit_bias": _logit_bias(body),
    }


def _stream_options(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad(f"'stream_options' must be an object, got {_kind(options)}", "stream_options")
    include = get_bool(options, "include_usage", default=False)
    continuous = get_bool(options, "continuous_usage_stats", default=False)
    return include, include and continuous


def _model(body: Mapping[str, Any]) -> str | None:
    value = body.get("model")
    return None if value is None else check_text(value, "model", allow_empty=False)


def _common(body: Mapping[str, Any], max_tokens: int | None, *, chat: bool) -> dict[str, Any]:
    _refuse_unsupported(body, chat=chat)
    stream = get_bool(body, "stream", default=False)
    include_usage, continuous = _stream_options(body, stream)
    return {
        "model": _model(body),
        "max_tokens": max_tokens,
        "temperature": get_number(body, "temperature", default=1.0, lo=0.0, hi=2.0),
        "top_p": get_number(body, "top_p", default=1.0, lo=0.0, hi=1.0, open_lo=True),
        "seed": get_int(body, "seed", default=None, minimum=MIN_SEED, maximum=MAX_SEED),
        "stop": _stop(body),
        "ignore_eos": get_bool(body, "ignore_eos", default=False),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "priority": get_int(body, "priority", default=0),
        **_sampling(body, chat=chat),
    }


def _max_tokens(body: Mapping[str, Any], default: int | None, *, echo: bool = False) -> int | None:
    completion = get_int(body, "max_completion_tokens", default=None, minimum=1)
    legacy = get_int(body, "max_tokens", default=None, minimum=0 if echo else 1)
    if completion is not None:
        return completion
    return legacy if legacy is not None else default


# -- the two endpoints ------------------------------------------------------------------------------
def parse_completion(body: Mapping[str, Any]) -> GenerationRequest:
    prompt, token_ids = _prompt(body)
    echo = get_bool(body, "echo", default=False)  # max_tokens 0 with echo: the prompt alone
    fields = _common(body, _max_tokens(body, COMPLETION_DEFAULT_MAX_TOKENS, echo=echo), chat=False)
    return GenerationRequest(chat=False, prompt=prompt, prompt_token_ids=token_ids, messages=(), **fields)


def parse_chat(body: Mapping[str, Any]) -> GenerationRequest:
    messages = _messages(body)
    fields = _common(body, _max_tokens(body, None), chat=True)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return GenerationRequest(
        chat=True, prompt=None, prompt_token_ids=None, messages=messages, max_tokens_field=field, **fields
    )


def _prompt(body: Mapping[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    """A string, an array of token ids, or an array holding exactly one of those."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", "prompt")
    value = body["prompt"]
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise bad(
                f"'prompt' holds {len(value)} prompts; send one prompt per request (batches are not supported)",
                "prompt",
            )
        value = value[0]
    if isinstance(value, str):
        return check_text(value, "prompt"), None
    if isinstance(value, list):
        if not value:
            raise bad("'prompt' must not be empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT for t in value):
            raise bad("'prompt' given as an array must hold token ids (integers >= 0)", "prompt")
        return None, tuple(value)
    raise bad(f"'prompt' must be a string or an array of token ids, got {_kind(value)}", "prompt")


def _messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    value = body.get("messages")
    if value is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    return tuple(_message(item, i) for i, item in enumerate(value))


def _message(item: object, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(item, dict):
        raise bad(f"'{where}' must be an object, got {_kind(item)}", where)
    role = item.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    if content is None and role in ("assistant", "tool"):
        return ChatMessage(role, "")
    if isinstance(content, str):
        return ChatMessage(role, check_text(content, f"{where}.content"))
    if not isinstance(content, list):
        raise bad(
            f"'{where}.content' must be a string or an array of text parts, got {_kind(content)}", f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            got = part.get("type") if isinstance(part, dict) else _kind(part)
            raise bad(
                f'\'{at}\': only text parts ({{"type": "text", "text": ...}}) are supported, got {got!r}', f"{at}.type"
            )
        texts.append(check_text(part.get("text"), f"{at}.text"))
    return ChatMessage(role, "\n".join(texts))
