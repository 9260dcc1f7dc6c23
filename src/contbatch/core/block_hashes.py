"""Block hashes for prefix caching: one per full block of a request's known tokens.

A block's hash chains over every token before its end, so equal prefixes give equal hashes:
`prompt_block_hashes` hashes a prompt given as token ids (block i: hash((hash of block i-1,
its tokens)), starting from 0). `extend_block_hashes` continues a request's chain over its
output tokens as blocks fill, as vLLM does, so that a request preempted by recompute finds its
own prompt and output blocks again, and a later prompt that repeats a whole conversation finds
the earlier request's output blocks.

Invariant: `request.block_hashes[i]` identifies tokens [0, (i + 1) * block_size) of the request.
With prompt token ids known (the engine, the server) the chain is the same function of the
tokens whether they came as prompt or as output. With lengths only (the simulator), the prompt
hashes come from the trace and the blocks after them are the request's own: their hashes mix
in the request id.
"""

from __future__ import annotations

from collections.abc import Sequence

from contbatch.core.request import Request


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of `token_ids`."""
    hashes: list[int] = []
    running = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        running = hash((running, tuple(token_ids[start : start + block_size])))
        hashes.append(running)
    return tuple(hashes)


def extend_block_hashes(request: Request, block_size: int, num_blocks: int) -> None:
    """Give `request` hashes for its first `num_blocks` blocks (no-op when it has them). Each
    block must be full of known tokens (prompt then output): ValueError otherwise."""
    have = len(request.block_hashes)
    if num_blocks <= have:
        return
    if num_blocks * block_size > request.num_known_tokens:
        raise ValueError(
            f"request {request.request_id!r}: block {num_blocks - 1} is not full "
            f"({request.num_known_tokens} known tokens, block size {block_size})"
        )
    hashes = list(request.block_hashes)
    running = hashes[-1] if hashes else 0
    num_prompt = request.num_prompt_tokens
    prompt_ids = request.prompt_token_ids
    output_ids = request.output_token_ids
    for i in range(have, num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        outputs = output_ids[max(start - num_prompt, 0) : end - num_prompt] if end > num_prompt else []
        if prompt_ids:
            running = hash((running, (*prompt_ids[start:end], *outputs)))
        else:
            running = hash((running, request.request_id, tuple(outputs)))
        hashes.append(running)
    request.block_hashes = tuple(hashes)
