"""External KV (`Request.num_external_tokens`): a request whose leading prompt KV was computed
elsewhere (a KV transfer from a prefill replica) is admitted after those tokens, as after a
prefix-cache hit: at most prompt - 1 (one token is computed to sample from), its blocks taken
under this scheduler's budget (it waits, never dropped, while they do not fit), the longer of a
prefix hit and the external count, and a recompute preemption later computes its whole prompt.
"""

from __future__ import annotations

import pytest

from contbatch.core import ContinuousScheduler, FinishReason, Request, SchedulerConfig, check_invariants
from contbatch.core.config import KVConfig

from .drive import run_to_end, sampled, step


def make(num_blocks: int | None = 32, block_size: int = 4, caching: bool = False, **kw: object) -> ContinuousScheduler:
    kv = None
    if num_blocks is not None:
        kv = KVConfig(block_size=block_size, num_blocks=num_blocks, watermark=0.0, enable_prefix_caching=caching)
    return ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64, kv=kv, **kw))  # type: ignore[arg-type]


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="num_external_tokens"):
        Request("a", 0.0, 8, 4, num_external_tokens=9)
    with pytest.raises(ValueError, match="num_external_tokens"):
        Request("a", 0.0, 8, 4, num_external_tokens=-1)


@pytest.mark.parametrize("num_blocks", [None, 32])
def test_first_chunk_starts_after_the_external_tokens(num_blocks: int | None) -> None:
    s = make(num_blocks)
    request = Request("d", 0.0, 20, 3, num_external_tokens=20)
    s.add_request(request, 0.0)
    out = s.schedule(0.0)
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_new_tokens, chunk.samples) == (19, 1, True)  # the last prompt token, sampled
    if num_blocks is not None:
        assert request.kv_capacity == 20  # blocks for the whole prompt: the transferred KV lives in them
    s.update(out, sampled(out), 1.0)
    check_invariants(s)
    assert request.num_output_tokens == 1 and request.timeline.token_ts == [1.0]
    run_to_end(s, 1.0)
    assert request.finish_reason is FinishReason.LENGTH and request.num_output_tokens == 3


def test_partial_external_kv_computes_the_rest() -> None:
    s = make()
    request = Request("d", 0.0, 20, 2, num_external_tokens=8)
    s.add_request(request, 0.0)
    out = step(s, 0.0)
    assert [(c.start, c.num_new_tokens) for c in out.chunks] == [(8, 12)]


def test_waits_for_blocks_and_is_never_dropped() -> None:
    """The decode side's budget: a transferred request waits while its prompt's blocks do not fit."""
    s = make(num_blocks=8)  # 32 tokens
    big = Request("big", 0.0, 24, 4)
    s.add_request(big, 0.0)
    step(s, 0.0)
    moved = Request("moved", 0.5, 20, 2, num_external_tokens=20)
    assert s.add_request(moved, 1.0)
    out = step(s, 1.0)
    assert "moved" not in [c.request_id for c in out.chunks]  # 24 + 20 tokens do not fit 32
    run_to_end(s, 2.0)
    assert moved.finish_reason is FinishReason.LENGTH
    assert moved.timeline.scheduled_ts[0] > big.timeline.scheduled_ts[0]


def test_a_request_that_can_never_fit_is_rejected_with_its_reason() -> None:
    s = make(num_blocks=4)
    request = Request("huge", 0.0, 40, 4, num_external_tokens=40)
    decision = s.add_request(request, 0.0)
    assert not decision.queued and decision.reject_kind == "kv_capacity"
    assert request.finish_reason is FinishReason.REJECTED


def test_longer_prefix_hit_wins() -> None:
    s = make(caching=True)
    shared = (7, 8, 9)  # three full blocks of 4
    first = Request("first", 0.0, 14, 2, block_hashes=(*shared,))
    s.add_request(first, 0.0)
    run_to_end(s, 0.0)
    second = Request("second", 5.0, 14, 2, block_hashes=(*shared,), num_external_tokens=4)
    s.add_request(second, 5.0)
    out = step(s, 5.0)
    assert [(c.start, c.num_new_tokens) for c in out.chunks] == [(12, 2)]  # the 12 cached tokens, not 4
    assert s.stats.num_prefix_hit_tokens == 12


def test_a_recompute_preemption_computes_the_whole_prompt_again() -> None:
    s = make(num_blocks=12)  # 48 tokens; the newest running request is the victim
    other = Request("other", 0.0, 8, 30)
    s.add_request(other, 0.0)
    step(s, 0.0)
    moved = Request("moved", 1.0, 16, 30, num_external_tokens=16)
    s.add_request(moved, 1.0)
    out = step(s, 1.0)
    assert [(c.request_id, c.start) for c in out.chunks] == [("other", 8), ("moved", 15)]
    now = 2.0
    while moved.num_preemptions == 0:
        step(s, now)
        now += 1.0
    assert moved.num_computed_tokens == 0
    starts = []
    while s.has_unfinished():
        out = step(s, now)
        starts += [c.start for c in out.chunks if c.request_id == "moved"]
        now += 1.0
    assert starts[0] == 0  # recomputed here, from the first token
    assert moved.finish_reason is FinishReason.LENGTH and other.finish_reason is FinishReason.LENGTH


def test_seed_semantics_compute_the_last_prompt_token_then_decode() -> None:
    s = make(sample_on_prefill=False)
    request = Request("d", 0.0, 10, 2, num_external_tokens=10)
    s.add_request(request, 0.0)
    out = step(s, 0.0)
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_new_tokens, chunk.samples) == (9, 1, False)
    run_to_end(s, 1.0)
    assert request.num_output_tokens == 2
