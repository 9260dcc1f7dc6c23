"""Prompt-lookup (n-gram) draft tokens for speculative decoding: vLLM's ngram proposer.

`propose_ngram(tokens, k, min_n, max_n)`: find the longest n-gram, `min_n <= n <= max_n`, that
ends the sequence and also occurs earlier in it (the most recent such occurrence, wholly before
the last token), and propose the up to `k` tokens that followed that occurrence (fewer when the
sequence ends sooner; none when nothing matches). Deterministic and model-free: the drafts are
only a guess, verified by the target model in one forward (`contbatch.engine.runner`).

Cost: O(len(tokens)) per call, in C: the ids packed into bytes (8 a token; `pack`, which a caller
may keep per sequence and extend) and searched with `rfind`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = array("q").itemsize


def pack(tokens: Sequence[int]) -> bytearray:
    """`tokens` as the byte string `propose_ngram` searches (8 bytes a token); a caller that keeps
    one per sequence extends it with `pack(new tokens)`."""
    return bytearray(array("q", tokens).tobytes())


def propose_ngram(
    tokens: Sequence[int], k: int, min_n: int, max_n: int, packed: bytes | bytearray | None = None
) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens` (see the module docstring); `packed`, when
    given, is `pack(tokens)` kept by the caller."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    if packed is None:
        packed = array("q", tokens).tobytes()
    elif len(packed) != length * _ITEM:
        raise ValueError(f"packed holds {len(packed) // _ITEM} tokens, the sequence {length}")
    limit = (length - 1) * _ITEM  # an occurrence must end before the last token
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = packed[(length - n) * _ITEM :]
        end = limit
        while True:
            at = packed.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % _ITEM == 0:  # aligned on a token, not across two
                begin = at // _ITEM + n
                return list(tokens[begin : begin + k])
            end = at + len(pattern) - 1
    return []
