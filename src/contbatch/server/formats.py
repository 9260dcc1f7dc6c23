"""OpenAI response bodies and stream chunks, and the HTTP answer for each way a request can end.

Streams are Server-Sent Events: one ``data: {json}`` line per chunk, then ``data: [DONE]``. A
completion chunk is ``{"id", "object": "text_completion", "created", "model", "choices":
[{"index": 0, "text", "logprobs": null, "finish_reason"}]}``; a chat chunk has
``"object": "chat.completion.chunk"`` and ``"delta": {"content"}`` (the first one also
``"role": "assistant"``). With ``stream_options.include_usage`` the last chunk before
``[DONE]`` has ``"choices": []`` and ``usage``; with ``continuous_usage_stats`` every chunk
carries the usage so far. A request that ends badly mid-stream gets one ``data: {"error": ...}``
chunk, then ``[DONE]``.

Finish reasons: ``length`` and ``stop`` are successes; a rejection is 429 (queue full, with
``Retry-After``) or 400 (it can never fit); a timeout 504; an executor error 500; a cancellation
by the server (shutdown) 503.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from contbatch.core.status import FinishReason
from contbatch.server.protocol import APIError
from contbatch.server.types import RequestEvent

DONE = b"data: [DONE]\n\n"
SUCCESS = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop"}
_REJECT_PARAMS = {"max_model_len": "max_tokens", "kv_capacity": "prompt", "token_budget": "prompt"}


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    response_id: str  # "cmpl-..." or "chatcmpl-..."
    created: int  # unix seconds
    model: str
    chat: bool


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def usage(event: RequestEvent) -> dict[str, int]:
    return {
        "prompt_tokens": event.num_prompt_tokens,
        "completion_tokens": event.num_output_tokens,
        "total_tokens": event.num_prompt_tokens + event.num_output_tokens,
    }


def error_for(event: RequestEvent, *, retry_after_s: int = 1) -> APIError | None:
    """The HTTP error of a final event; None for a success (length, stop)."""
    reason = event.finish_reason
    detail = event.finish_detail
    if reason is None or reason in SUCCESS:
        return None
    if reason is FinishReason.REJECTED:
        if event.reject_kind == "queue_full":
            return APIError(
                429,
                f"the server is overloaded: {detail}; retry later",
                code="queue_full",
                headers={"Retry-After": str(retry_after_s)},
            )
        param = _REJECT_PARAMS.get(event.reject_kind)
        return APIError(400, f"the request can never be served: {detail}", param=param, code=event.reject_kind)
    if reason is FinishReason.TIMEOUT:
        return APIError(504, f"the request timed out: {detail}", code="timeout")
    if reason is FinishReason.CANCELLED:
        return APIError(503, f"the request was cancelled: {detail}", code="cancelled")
    return APIError(500, f"the request failed: {detail}", code="internal_error")


def _base(meta: ResponseMeta, chunk: bool) -> dict[str, object]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if meta.chat else "text_completion"
    return {"id": meta.response_id, "object": kind, "created": meta.created, "model": meta.model}


def response_body(meta: ResponseMeta, text: str, final: RequestEvent) -> dict[str, object]:
    """The non-streaming response of a successful request."""
    reason = SUCCESS.get(final.finish_reason) if final.finish_reason is not None else None
    choice: dict[str, object] = {"index": 0}
    if meta.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = reason
    body = _base(meta, chunk=False)
    body["choices"] = [choice]
    body["usage"] = usage(final)
    return body


def chunk(
    meta: ResponseMeta, text: str, finish_reason: str | None, *, first: bool, event_usage: dict[str, int] | None
) -> bytes:
    choice: dict[str, object] = {"index": 0}
    if meta.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    body = _base(meta, chunk=True)
    body["choices"] = [choice]
    if event_usage is not None:
        body["usage"] = event_usage
    return sse(body)


def usage_chunk(meta: ResponseMeta, final: RequestEvent) -> bytes:
    body = _base(meta, chunk=True)
    body["choices"] = []
    body["usage"] = usage(final)
    return sse(body)
