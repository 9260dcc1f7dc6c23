"""OpenAI response bodies and stream chunks, and the HTTP answer for each way a request can end.

Streams are Server-Sent Events: one ``data: {json}`` line per chunk, then ``data: [DONE]``. A
completion chunk is ``{"id", "object": "text_completion", "created", "model", "choices":
[{"index", "text", "logprobs", "finish_reason"}]}``; a chat chunk has
``"object": "chat.completion.chunk"`` and ``"delta": {"content"}`` (the first one of each choice
also ``"role": "assistant"``). With ``n`` choices each chunk carries one choice, named by its
``index``; the choices' chunks interleave as their tokens come. With
``stream_options.include_usage`` the last chunk before ``[DONE]`` has ``"choices": []`` and
``usage``; with ``continuous_usage_stats`` every chunk carries the usage so far (its choice's).
A request that ends badly mid-stream gets one ``data: {"error": ...}`` chunk, then ``[DONE]``.

Usage: ``prompt_tokens`` once, ``completion_tokens`` summed over the choices (OpenAI's). With
``echo`` and ``max_tokens`` 0 no output comes back and ``completion_tokens`` is 0.

Log-probabilities (`Renderer`), as OpenAI and vLLM shape them:
- completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per
  token; ``top_logprobs`` maps each of the k most likely tokens, plus the chosen one, to its
  log-probability (up to k + 1 entries); ``text_offset`` is each token's offset in the choice's
  text (the echoed prompt included). With ``echo`` the prompt's tokens come first, the first one
  with ``null`` log-probability and ``null`` top log-probabilities;
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`` with exactly the k most likely tokens.
A token's text is its id decoded alone (special tokens kept); -inf is reported as -9999.0.

Finish reasons: ``length`` and ``stop`` are successes; a rejection is 429 (queue full, with
``Retry-After``) or 400 (it can never fit); a timeout 504; an executor error 500; a cancellation
by the server (shutdown) 503.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from contbatch.core.outputs import TokenLogprobs
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


def usage(event: RequestEvent, *, num_output_tokens: int | None = None) -> dict[str, int]:
    completion = event.num_output_tokens if num_output_tokens is None else num_output_tokens
    return {
        "prompt_tokens": event.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": event.num_prompt_tokens + completion,
    }


def total_usage(finals: Sequence[RequestEvent], *, hide_output: bool = False) -> dict[str, int]:
    """The usage of a request's choices: the prompt once, the outputs summed."""
    completion = 0 if hide_output else sum(e.num_output_tokens for e in finals)
    return usage(finals[0], num_output_tokens=completion)


def error_for(
    event: RequestEvent, *, retry_after_s: int = 1, reject_params: Mapping[str, str] | None = None
) -> APIError | None:
    """The HTTP error of a final event; None for a success (length, stop). `reject_params`
    overrides which request field a rejection kind names."""
    reason = event.finish_reason
    detail = event.finish_detail
    if reason is None or reason in SUCCESS:
        return None
    if reason is FinishReason.REJECTED and event.reject_kind != "internal":  # internal: the server's fault, a 500
        if event.reject_kind == "queue_full":
            return APIError(
                429,
                f"the server is overloaded: {detail}; retry later",
                code="queue_full",
                headers={"Retry-After": str(retry_after_s)},
            )
        param = (reject_params or _REJECT_PARAMS).get(event.reject_kind, _REJECT_PARAMS.get(event.reject_kind))
        return APIError(400, f"the request can never be served: {detail}", param=param, code=event.reject_kind)
    if reason is FinishReason.TIMEOUT:
        return APIError(504, f"the request timed out: {detail}", code="timeout")
    if reason is FinishReason.CANCELLED:
        return APIError(503, f"the request was cancelled: {detail}", code="cancelled")
    return APIError(500, f"the request failed: {detail}", code="internal_error")


# -- one choice's text and log-probabilities -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Echo:
    """The prompt a completion echoes: its text and its token ids (for its log-probabilities)."""

    text: str
    token_ids: tuple[int, ...]


class Renderer:
    """One choice's text and log-probabilities, output by output (see the module docstring).
    `decode` turns token ids into text; `num_top` is None without logprobs; `hide_output`
    (echo with max_tokens 0) drops the generated tokens."""

    def __init__(
        self,
        *,
        chat: bool,
        decode: Callable[[Sequence[int]], str],
        num_top: int | None = None,
        echo: Echo | None = None,
        hide_output: bool = False,
    ) -> None:
        self.chat = chat
        self._decode = decode
        self.num_top = num_top
        self.echo = echo
        self.hide_output = hide_output
        self._offset = 0  # characters of token text so far (text_offset)
        self._started = False
        self._texts: dict[int, str] = {}

    def render(self, event: RequestEvent) -> tuple[str, dict[str, object] | None]:
        """The text and the logprobs object (None without logprobs) an output adds."""
        text = ""
        entries: list[tuple[int, TokenLogprobs | None]] = []
        if not self._started and (event.token_ids or event.is_final):
            self._started = True
            if self.echo is not None:
                text += self.echo.text
                if self.num_top is not None:
                    entries.extend(self._prompt_entries(event.prompt_logprobs))
        if not self.hide_output:
            text += event.text
            if self.num_top is not None:
                found = event.logprobs
                entries.extend((token, found[i] if i < len(found) else None) for i, token in enumerate(event.token_ids))
        if self.num_top is None:
            return text, None
        return text, self._chat_logprobs(entries) if self.chat else self._completion_logprobs(entries)

    def _prompt_entries(self, found: Sequence[TokenLogprobs | None] | None) -> list[tuple[int, TokenLogprobs | None]]:
        assert self.echo is not None
        ids = self.echo.token_ids
        got = found or ()
        return [(token, got[i] if i < len(got) else None) for i, token in enumerate(ids)]

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode((token_id,))
        return text

    def _completion_logprobs(self, entries: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, object]:
        k = self.num_top or 0
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token, entry in entries:
            text = self.token_text(token)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry.logprob)
            top = {self.token_text(t): lp for t, lp in entry.top[:k]}
            top.setdefault(text, entry.logprob)
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, entries: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, object]:
        k = self.num_top or 0
        content = []
        for token, entry in entries:
            text = self.token_text(token)
            top = [] if entry is None else [self._chat_entry(t, lp) for t, lp in entry.top[:k]]
            item = self._chat_entry(token, None if entry is None else entry.logprob)
            item["top_logprobs"] = top
            content.append(item)
            self._offset += len(text)
        return {"content": content}

    def _chat_entry(self, token: int, logprob: float | None) -> dict[str, object]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merge_logprobs(so_far: dict[str, object] | None, more: dict[str, object] | None) -> dict[str, object] | None:
    """Two consecutive logprobs objects of one choice as one (their lists concatenated)."""
    if so_far is None or more is None:
        return more if so_far is None else so_far
    merged: dict[str, object] = {}
    for key, value in so_far.items():
        extra = more.get(key)
        assert isinstance(value, list) and isinstance(extra, list)
        merged[key] = value + extra
    return merged


# -- bodies and chunks -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One choice of a non-streaming response."""

    index: int
    text: str
    logprobs: dict[str, object] | None
    final: RequestEvent


def _base(meta: ResponseMeta, chunk: bool) -> dict[str, object]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if meta.chat else "text_completion"
    return {"id": meta.response_id, "object": kind, "created": meta.created, "model": meta.model}


def _reason(event: RequestEvent) -> str | None:
    return SUCCESS.get(event.finish_reason) if event.finish_reason is not None else None


def response_body(
    meta: ResponseMeta,
    text: str | Sequence[ChoiceResult],
    final: RequestEvent | None = None,
    *,
    hide_output: bool = False,
) -> dict[str, object]:
    """The non-streaming response of a successful request: `response_body(meta, choices)`, or
    `response_body(meta, text, final)` for one choice without logprobs."""
    if isinstance(text, str):
        assert final is not None
        choices: Sequence[ChoiceResult] = [ChoiceResult(0, text, None, final)]
    else:
        choices = text
    items = []
    for result in choices:
        choice: dict[str, object] = {"index": result.index}
        if meta.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        choice["logprobs"] = result.logprobs
        choice["finish_reason"] = _reason(result.final)
        items.append(choice)
    body = _base(meta, chunk=False)
    body["choices"] = items
    body["usage"] = total_usage([r.final for r in choices], hide_output=hide_output)
    return body


def chunk(
    meta: ResponseMeta,
    text: str,
    finish_reason: str | None,
    *,
    first: bool,
    event_usage: dict[str, int] | None,
    index: int = 0,
    logprobs: dict[str, object] | None = None,
) -> bytes:
    choice: dict[str, object] = {"index": index}
    if meta.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    body = _base(meta, chunk=True)
    body["choices"] = [choice]
    if event_usage is not None:
        body["usage"] = event_usage
    return sse(body)


def usage_chunk(
    meta: ResponseMeta, final: RequestEvent | Sequence[RequestEvent], *, hide_output: bool = False
) -> bytes:
    body = _base(meta, chunk=True)
    body["choices"] = []
    body["usage"] = total_usage([final] if isinstance(final, RequestEvent) else final, hide_output=hide_output)
    return sse(body)
