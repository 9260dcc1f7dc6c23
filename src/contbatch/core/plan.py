"""What a request needs next: the one place that turns a request's state into a chunk.

Token-centric accounting (`contbatch.core.scheduler` states the model). With `k` output tokens
sampled, a request knows `P + k` tokens (prompt `P`). Under engine semantics
(`sample_on_prefill`) the KV of all known tokens must exist before token `k + 1` is sampled: the
target is `P + k`, and the step that reaches it samples. Steady decoding is then one token per
step, plus up to `num_speculative_tokens` draft tokens verified in the same chunk (never more
than the output limit leaves room for). Under the seed's teaching semantics a decode is a
separate unit of work: the step that completes the prompt samples nothing, and each later step
computes one decode unit and samples.
"""

from __future__ import annotations

from contbatch.core.outputs import ScheduledChunk, new_chunk
from contbatch.core.request import Request


def plan_chunk(
    request: Request,
    max_tokens: int,
    *,
    sample_on_prefill: bool,
    allow_split: bool,
    num_speculative_tokens: int = 0,
    max_prefill_tokens: int | None = None,
) -> ScheduledChunk | None:
    """The request's next chunk using at most `max_tokens` tokens; None when it cannot take one
    (no tokens left, or a whole prefill that must not be split does not fit). A split prefill
    chunk takes at most `max_prefill_tokens`."""
    computed = request.num_computed_tokens
    known = request.num_known_tokens
    if sample_on_prefill or computed < known:
        target = known
        samples_at_target = sample_on_prefill
        is_decode = sample_on_prefill and computed == known - 1 and computed >= request.num_prompt_tokens
    else:
        target = known + 1
        samples_at_target = True
        is_decode = True
    wanted = target - computed
    if is_decode:
        room = request.max_output_tokens - request.num_output_tokens - 1
        num_new = min(1 + min(num_speculative_tokens, room), max_tokens)
    elif allow_split:
        num_new = min(wanted, max_tokens, max_prefill_tokens or wanted)
    else:
        num_new = wanted
    if num_new < 1 or num_new > max_tokens:
        return None
    samples = samples_at_target and (is_decode or computed + num_new == target)
    return new_chunk(ScheduledChunk, (request.request_id, computed, num_new, not is_decode, samples))
