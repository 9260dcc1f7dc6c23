"""plan_chunk under both sampling semantics.

engine (`sample_on_prefill=True`): the step that completes the prompt samples the first token,
chunked prefill samples only on its last chunk, a decode is one token; after a recompute
preemption the prompt and the outputs so far are recomputed and the last chunk samples.
seed (`sample_on_prefill=False`): a prefill never samples; each later step decodes one token and
samples.
"""

from __future__ import annotations

import itertools

from contbatch.core.outputs import ScheduledChunk
from contbatch.core.plan import plan_chunk
from contbatch.core.request import Request

BIG = 1 << 30
CLOCK = itertools.count(1.0)  # strictly increasing timestamps for every recorded event


def engine(request: Request, max_tokens: int = BIG, *, split: bool = True) -> ScheduledChunk | None:
    return plan_chunk(request, max_tokens, sample_on_prefill=True, allow_split=split)


def seed(request: Request, max_tokens: int = BIG, *, split: bool = False) -> ScheduledChunk | None:
    return plan_chunk(request, max_tokens, sample_on_prefill=False, allow_split=split)


def apply(request: Request, chunk: ScheduledChunk | None) -> None:
    """What `update` does with a chunk: advance computed tokens, append a sample (at a later time
    than anything the request recorded so far)."""
    now = next(CLOCK)
    assert chunk is not None
    assert chunk.start == request.num_computed_tokens
    request.num_computed_tokens = chunk.start + chunk.num_new_tokens
    if chunk.samples:
        request.append_output((0,), now)


def running(prompt: int, output: int = 10) -> Request:
    request = Request("r", 0.0, prompt, output)
    request.admit(0.0)
    return request


# -- engine semantics ---------------------------------------------------------------------------
def test_engine_whole_prefill_samples() -> None:
    r = running(5)
    assert engine(r) == ScheduledChunk("r", 0, 5, True, True)
    assert engine(r, 5, split=False) == ScheduledChunk("r", 0, 5, True, True)


def test_engine_prompt_of_one_token_is_a_prefill() -> None:
    r = running(1)
    assert engine(r) == ScheduledChunk("r", 0, 1, True, True)


def test_engine_decode_is_one_token() -> None:
    r = running(5)
    apply(r, engine(r))
    assert (r.num_computed_tokens, r.num_known_tokens) == (5, 6)
    for step in range(3):
        chunk = engine(r)
        assert chunk == ScheduledChunk("r", 5 + step, 1, False, True)
        apply(r, chunk)
    assert r.num_output_tokens == 4


def test_engine_chunked_prefill_samples_on_the_last_chunk_only() -> None:
    r = running(10)
    first = engine(r, 4)
    assert first == ScheduledChunk("r", 0, 4, True, False)
    apply(r, first)
    second = engine(r, 4)
    assert second == ScheduledChunk("r", 4, 4, True, False)
    apply(r, second)
    last = engine(r, 4)
    assert last == ScheduledChunk("r", 8, 2, True, True)  # takes only what it needs
    apply(r, last)
    assert r.num_output_tokens == 1
    assert engine(r, 4) == ScheduledChunk("r", 10, 1, False, True)


def test_engine_unsplittable_prefill_that_does_not_fit() -> None:
    r = running(10)
    assert engine(r, 9, split=False) is None
    assert engine(r, 0, split=True) is None
    assert engine(r, 0, split=False) is None


def test_engine_recompute_after_preemption_samples_at_the_end() -> None:
    r = running(6)
    apply(r, engine(r))  # prefill, first token
    apply(r, engine(r))  # a decode, second token
    assert (r.num_computed_tokens, r.num_output_tokens) == (7, 2)
    r.preempt(next(CLOCK))
    assert r.num_computed_tokens == 0 and r.num_known_tokens == 8
    r.admit(next(CLOCK))
    whole = engine(r)
    assert whole == ScheduledChunk("r", 0, 8, True, True)  # prompt + both outputs, then sample
    chunks = []
    while r.num_output_tokens == 2:
        chunk = engine(r, 3)
        chunks.append(chunk)
        apply(r, chunk)
    assert chunks == [
        ScheduledChunk("r", 0, 3, True, False),
        ScheduledChunk("r", 3, 3, True, False),
        ScheduledChunk("r", 6, 2, True, True),
    ]
    assert engine(r) == ScheduledChunk("r", 8, 1, False, True)


def test_engine_recompute_unsplit_must_fit_whole() -> None:
    r = running(6)
    apply(r, engine(r))
    r.preempt(next(CLOCK))
    assert engine(r, 6, split=False) is None  # needs 7: prompt 6 + 1 output
    assert engine(r, 7, split=False) == ScheduledChunk("r", 0, 7, True, True)


# -- seed semantics -----------------------------------------------------------------------------
def test_seed_prefill_never_samples_and_decode_samples() -> None:
    r = running(4)
    prefill = seed(r)
    assert prefill == ScheduledChunk("r", 0, 4, True, False)
    apply(r, prefill)
    assert r.num_output_tokens == 0 and r.num_computed_tokens == 4
    for step in range(3):
        decode = seed(r, 1)
        assert decode == ScheduledChunk("r", 4 + step, 1, False, True)
        apply(r, decode)
        assert r.num_output_tokens == step + 1
        assert r.num_computed_tokens == r.num_known_tokens


def test_seed_prefill_must_fit_whole_without_split() -> None:
    r = running(4)
    assert seed(r, 3) is None
    assert seed(r, 4) == ScheduledChunk("r", 0, 4, True, False)


def test_seed_chunked_prefill_never_samples() -> None:
    r = running(7)
    chunks = []
    while r.num_computed_tokens < 7:
        chunk = seed(r, 3, split=True)
        chunks.append(chunk)
        apply(r, chunk)
    assert chunks == [
        ScheduledChunk("r", 0, 3, True, False),
        ScheduledChunk("r", 3, 3, True, False),
        ScheduledChunk("r", 6, 1, True, False),
    ]
    assert seed(r, 3, split=True) == ScheduledChunk("r", 7, 1, False, True)


def test_seed_after_preemption_recomputes_without_sampling() -> None:
    r = running(4)
    apply(r, seed(r))
    apply(r, seed(r))
    r.preempt(next(CLOCK))
    assert r.num_known_tokens == 5
    assert seed(r) == ScheduledChunk("r", 0, 5, True, False)
