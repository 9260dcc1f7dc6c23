"""The simulator's executor: what a model would return for a step, without a model.

Token ids are dummies. A request stops (STOP) when it has produced its trace's output length
before reaching its output limit (as an EOS would end it); at the limit the scheduler ends it
(LENGTH). A decode chunk with k speculative drafts accepts each draft with probability
`acceptance_rate`, in order, stopping at the first rejection, and always yields one more token:
1 to k + 1 tokens. The random draws come from one seeded generator, so a run is reproducible.

Invariant: the executor never emits more tokens for a request than its trace's output length
(the scheduler cuts what exceeds the output limit).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, MutableMapping
from types import MappingProxyType

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, StepResult
from contbatch.core.status import FinishReason

DUMMY_TOKEN_ID = 0


class SimExecutor:
    def __init__(self, stop_lengths: Mapping[str, int], *, acceptance_rate: float = 1.0, seed: int = 0) -> None:
        """`stop_lengths`: output lengths of the requests that stop before their output limit."""
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate!r}")
        self._remaining = dict(stop_lengths)
        self._acceptance_rate = acceptance_rate
        self._rng = random.Random(seed)

    @property
    def stop_after(self) -> MutableMapping[str, int]:
        """Tokens each early-stopping request will still get before its stop: the live
        countdowns, which a decode run (`contbatch.sim.decode_run`) decrements for the tokens it
        emits without calling `execute`."""
        return self._remaining

    def execute(self, out: SchedulerOutput) -> StepResult:
        return sample_counting_down(out, self._remaining, DUMMY_TOKEN_ID, self._decode_tokens)

    def _decode_tokens(self, chunk: ScheduledChunk) -> int:
        return self._accepted(chunk.num_new_tokens - 1) + 1

    def _accepted(self, num_drafts: int) -> int:
        if num_drafts == 0 or self._acceptance_rate == 1.0:
            return num_drafts
        rng, rate = self._rng, self._acceptance_rate
        accepted = 0
        while accepted < num_drafts and rng.random() < rate:
            accepted += 1
        return accepted


def sample_counting_down(
    out: SchedulerOutput,
    countdowns: MutableMapping[str, int],
    token_id: int,
    decode_tokens: Callable[[ScheduledChunk], int],
) -> StepResult:
    """A step's result without a model: every sampling chunk yields `token_id`s, one for a
    prefill chunk or a one-token decode, `decode_tokens(chunk)` for a decode chunk with drafts
    (called in chunk order); a request with a countdown gets at most what it has left, and STOP
    when that reaches 0. (`decode_tokens` of a one-token decode must be 1: it is not called.)
    Both mappings list their requests in chunk order.

    Cost: two comprehensions over the chunks, then Python work only for the decodes with drafts
    and the requests with a countdown (none in most steps)."""
    chunks = out.chunks
    one = (token_id,)  # shared by every one-token sample (tuples are immutable)
    # (a chunk is (request id, start, num_new_tokens, is_prefill, samples))
    sampled: dict[str, tuple[int, ...]] = dict.fromkeys([c[0] for c in chunks if c[4]], one)
    for chunk in [c for c in chunks if c[4] and c[2] != 1 and not c[3]]:  # decodes with drafts
        sampled[chunk[0]] = one * decode_tokens(chunk)
    finished = _count_down(sampled, countdowns, one) if countdowns else {}
    # handed over without a copy: nothing else holds these dicts
    return StepResult(sampled_token_ids=MappingProxyType(sampled), finished=MappingProxyType(finished))


def _count_down(
    sampled: dict[str, tuple[int, ...]], countdowns: MutableMapping[str, int], one: tuple[int]
) -> dict[str, FinishReason]:
    """Cut each sample in `sampled` to its request's countdown, in place, and count it down;
    the requests it stops (STOP), in `sampled`'s order."""
    finished: dict[str, FinishReason] = {}
    for rid in [r for r in sampled if r in countdowns]:
        remaining = countdowns[rid]
        num_tokens = min(len(sampled[rid]), remaining)
        countdowns[rid] = remaining - num_tokens
        if remaining == num_tokens:
            finished[rid] = FinishReason.STOP
            sampled[rid] = one * num_tokens
    return finished
