"""The OpenAI request bodies: reading, validating, and the error a bad one gets.

Everything a client can get wrong is answered here with an `APIError`: an HTTP status and the
OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}`` whose message and
``param`` name the field. Bodies larger than the limit get 413, bodies that are not UTF-8 or not
a JSON object 400. Unknown fields are ignored (as vLLM does); known features this server does
not have (n > 1, best_of > 1, echo, logprobs, suffix, tools, logit_bias, non-text response
formats or content parts) are refused with 400 rather than silently dropped.

Defaults: ``max_tokens`` is 16 for completions (OpenAI's); for chat, absent, the server's
default (or what the context leaves); ``max_completion_tokens`` wins over ``max_tokens``.
``temperature`` in [0, 2], ``top_p`` in (0, 1], ``presence_penalty``/``frequency_penalty`` in
[-2, 2] (accepted, ignored), ``stop`` a string or up to 16 strings, ``priority`` an integer
(lower runs first with a priority queue order).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from contbatch.server.backends.base import ChatMessage

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_INT = (1 << 31) - 1
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


# -- the body ---------------------------------------------------------------------------------
async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 beyond `limit` bytes, 400 unless UTF-8 JSON of an object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    return parse_json_object(b"".join(parts))


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


def get_int(body: Mapping[str, Any], name: str, *, default: int | None, minimum: int = -MAX_INT) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {_kind(value)}", name)
    if not minimum <= value <= MAX_INT:
        raise bad(f"'{name}' must be an integer from {minimum} to {MAX_INT}, got {value}", name)
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
    return tuple(check_text(s, "stop", allow_empty=False) for s in items)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """400 for features this server does not have, when asked for with a non-default value."""
    for name in ("n", "best_of"):
        count = get_int(body, name, default=1, minimum=1)
        if count != 1:
            raise bad(f"'{name}' = {count} is not supported: this server returns one choice (n = 1)", name)
    if get_bool(body, "echo", default=False):
        raise bad("'echo' is not supported", "echo")
    for name in ("logprobs", "top_logprobs"):
        value = body.get(name)
        if value is not None and value is not False and value != 0:
            raise bad(f"'{name}' is not supported", name)
    for name in ("suffix", "tools", "functions", "logit_bias"):
        if body.get(name):
            raise bad(f"'{name}' is not supported", name)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad('\'response_format\' is not supported (only {"type": "text"})', "response_format")
    get_number(body, "presence_penalty", default=0.0, lo=-2.0, hi=2.0)
    get_number(body, "frequency_penalty", default=0.0, lo=-2.0, hi=2.0)
    if body.get("user") is not None:
        check_text(body["user"], "user")


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


def _common(body: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any]:
    _refuse_unsupported(body)
    stream = get_bool(body, "stream", default=False)
    include_usage, continuous = _stream_options(body, stream)
    return {
        "model": _model(body),
        "max_tokens": max_tokens,
        "temperature": get_number(body, "temperature", default=1.0, lo=0.0, hi=2.0),
        "top_p": get_number(body, "top_p", default=1.0, lo=0.0, hi=1.0, open_lo=True),
        "seed": get_int(body, "seed", default=None, minimum=-MAX_INT),
        "stop": _stop(body),
        "ignore_eos": get_bool(body, "ignore_eos", default=False),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "priority": get_int(body, "priority", default=0),
    }


def _max_tokens(body: Mapping[str, Any], default: int | None) -> int | None:
    completion = get_int(body, "max_completion_tokens", default=None, minimum=1)
    legacy = get_int(body, "max_tokens", default=None, minimum=1)
    if completion is not None:
        return completion
    return legacy if legacy is not None else default


# -- the two endpoints ------------------------------------------------------------------------------
def parse_completion(body: Mapping[str, Any]) -> GenerationRequest:
    prompt, token_ids = _prompt(body)
    fields = _common(body, _max_tokens(body, COMPLETION_DEFAULT_MAX_TOKENS))
    return GenerationRequest(chat=False, prompt=prompt, prompt_token_ids=token_ids, messages=(), **fields)


def parse_chat(body: Mapping[str, Any]) -> GenerationRequest:
    messages = _messages(body)
    fields = _common(body, _max_tokens(body, None))
    return GenerationRequest(chat=True, prompt=None, prompt_token_ids=None, messages=messages, **fields)


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
