"""Request intake: a prompt becomes a scheduler `Request`, in one place for every driver.

`Intake.prompt_ids` tokenizes a text prompt (with the tokenizer it was given) or checks a prompt
given as token ids; `Intake.request` validates the rest and builds the `Request`: its output
limit (`max_tokens`, or whatever `max_model_len` leaves), its sampling parameters (carried to
the executor opaquely), and, with prefix caching, its prompt block hashes.

Prompt block hashes: one per full prompt block. `contbatch.core.block_hashes.prompt_block_hashes`
chains them over the token ids (block i's hash covers every token before its end: equal
prefixes, equal hashes); `group_block_hashes` is the simulator's version for traces that know lengths, not tokens
(requests of one prefix group share the hashes of the blocks wholly inside the shared prefix).

Invariants: a built request has at least one prompt token, every id in [0, vocab_size), and an
output limit >= 1; `IntakeError` (a ValueError) names what is wrong otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contbatch.core.block_hashes import prompt_block_hashes
from contbatch.core.request import Request
from contbatch.loop.params import SamplingParams


class IntakeError(ValueError):
    """A prompt or its parameters cannot become a request; the message says why."""


def group_block_hashes(
    request_id: str, num_prompt_tokens: int, block_size: int, *, group: str | None, num_shared_tokens: int
) -> tuple[int, ...]:
    """Hashes for a prompt known by length: blocks wholly inside the prefix shared by `group`
    hash alike across the group, the rest are the request's own."""
    num_shared = num_shared_tokens // block_size if group is not None else 0
    return tuple(
        hash(("prefix", group, i)) if i < num_shared else hash(("own", request_id, i))
        for i in range(num_prompt_tokens // block_size)
    )


@dataclass(frozen=True, slots=True)
class Intake:
    """Builds requests for one model: `encode` tokenizes text, `vocab_size` bounds token ids,
    `max_model_len` bounds prompt + output, `hash_block_size` (None: prefix caching off) sizes
    the prompt block hashes."""

    encode: Callable[[str], Sequence[int]] | None = None
    vocab_size: int | None = None
    max_model_len: int | None = None
    hash_block_size: int | None = None

    def prompt_ids(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        """The prompt's token ids (text tokenized, ids checked); IntakeError when empty or invalid."""
        if isinstance(prompt, str):
            if self.encode is None:
                raise IntakeError("this model takes token ids only (it has no tokenizer)")
            ids = tuple(self.encode(prompt))
        else:
            ids = tuple(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise IntakeError("a prompt given as token ids must hold integers only")
        if not ids:
            raise IntakeError("the prompt is empty (no tokens)")
        vocab = self.vocab_size
        bad = min(ids) if min(ids) < 0 else max(ids)
        if bad < 0 or (vocab is not None and bad >= vocab):
            raise IntakeError(f"the prompt holds token id {bad}, outside [0, {vocab})")
        return ids

    def request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_ts: float,
        priority: int = 0,
        tenant: str | None = None,
    ) -> Request:
        """The scheduler request for `prompt_ids` (checked by `prompt_ids`) and `params`."""
        ids = tuple(prompt_ids)
        if not ids:
            raise IntakeError("the prompt is empty (no tokens)")
        limit = self.max_model_len
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, limit - len(ids)) if limit is not None else 16
        vocab = self.vocab_size
        if params.logit_bias and vocab is not None and params.logit_bias[-1][0] >= vocab:
            raise IntakeError(f"logit_bias names token id {params.logit_bias[-1][0]}, outside [0, {vocab})")
        block_size = self.hash_block_size
        return Request(
            request_id,
            arrival_ts,
            len(ids),
            max_tokens,
            priority=priority,
            tenant=tenant,
            block_hashes=prompt_block_hashes(ids, block_size) if block_size else (),
            prompt_token_ids=ids,
            params=params,
            # prompt logprobs need every prompt position computed: no prefix-cache hits (vLLM's rule)
            skip_reading_prefix_cache=params.prompt_logprobs is not None,
        )
