"""What a router is told about a request before it is sent: a `RouteRequest` from its JSON body.

The gateway does not tokenize (its backends may serve any model) and forwards the body as it
came; it only reads it to route:

- prompt tokens: a prompt given as token ids is counted exactly; text (a completion's prompt, a
  chat's message contents joined by newlines) is estimated as its characters over
  `chars_per_token` (4: about right for English with a BPE tokenizer, and exact for the sim
  backend's prompts of short words, as `contbatch bench` sends them);
- output limit: ``max_completion_tokens``, else ``max_tokens``, else 16 for a completion (OpenAI's
  default) and `default_max_tokens` for a chat; times ``n``;
- prefix keys, only for routers that read them: chained keys of the text's full
  `prefix_block_chars`-character blocks (`contbatch.routing.text_block_keys`), or of 16-token
  blocks of token ids (`token_block_keys`), at most 256 blocks;
- the tenant, as the server would see it (`contbatch.server.auth.request_tenant`).

Fields of the wrong type are not refused here: they count as absent, and the backend answers them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from contbatch.routing import RouteRequest, text_block_keys, token_block_keys

COMPLETION_DEFAULT_MAX_TOKENS = 16
TOKEN_BLOCK = 16  # tokens per prefix key of a prompt given as token ids
MAX_PREFIX_BLOCKS = 256


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_int(v) is not None for v in value)


def prompt_of(body: Mapping[str, Any], *, chat: bool) -> tuple[str, list[int] | None]:
    """(text, token ids or None) of a request's prompt, for routing."""
    if chat:
        messages = body.get("messages")
        parts: list[str] = []
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # content parts: the text ones
                parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "\n".join(parts), None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if _is_ids(prompt):
        return "", [int(t) for t in prompt or ()]
    if isinstance(prompt, list) and prompt:  # a batch of prompts: routed as one request
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt), None
        if all(_is_ids(p) for p in prompt):
            return "", [t for p in prompt for t in p]
    return "", None


def route_request(
    body: Mapping[str, Any],
    request_id: str,
    *,
    chat: bool,
    tenant: str | None = None,
    chars_per_token: float = 4.0,
    default_max_tokens: int = 1024,
    prefix_block_chars: int | None = None,
) -> RouteRequest:
    """The `RouteRequest` of a body (module docstring); prefix keys only with `prefix_block_chars`."""
    text, ids = prompt_of(body, chat=chat)
    num_prompt = len(ids) if ids is not None else math.ceil(len(text) / chars_per_token)
    limit = _int(body.get("max_completion_tokens")) if chat else None
    if limit is None:
        limit = _int(body.get("max_tokens"))
    if limit is None:
        limit = default_max_tokens if chat else COMPLETION_DEFAULT_MAX_TOKENS
    n = _int(body.get("n"))
    limit = max(0, limit) * (n if n is not None and n > 1 else 1)
    keys: tuple[int, ...] = ()
    if prefix_block_chars is not None:
        if ids is not None:
            keys = token_block_keys(ids, TOKEN_BLOCK, MAX_PREFIX_BLOCKS)
        else:
            keys = text_block_keys(text, prefix_block_chars, MAX_PREFIX_BLOCKS)
    return RouteRequest(request_id, max(0, num_prompt), limit, keys, tenant)
