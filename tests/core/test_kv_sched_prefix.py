"""Prefix caching in the scheduler: a request's admission starts after the leading full blocks
already cached (whole blocks, fewer than its known tokens: one must be computed to sample), shares
those blocks (reference counts), and counts query / hit tokens on its first admission; a
re-admission after a recompute preemption finds its own prompt and output blocks if they are
still cached, and counts nothing again. Stepped by hand, `check_invariants` after every `update`.
"""

from __future__ import annotations

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    SchedulerConfig,
    check_invariants,
)
from contbatch.core.config import KVConfig

from .drive import sampled, step

SHARED = (101, 102)  # hashes of a prefix group's two full blocks


def make(num_blocks: int = 32, block_size: int = 4, caching: bool = True, budget: int = 64) -> ContinuousScheduler:
    kv = KVConfig(block_size=block_size, num_blocks=num_blocks, watermark=0.0, enable_prefix_caching=caching)
    return ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=budget, kv=kv))


def first_chunk(s: ContinuousScheduler, request: Request, now: float) -> tuple[int, int]:
    s.add_request(request, now)
    out = s.schedule(now)
    (chunk,) = [c for c in out.chunks if c.request_id == request.request_id]
    s.update(out, sampled(out), now + 1.0)
    check_invariants(s)
    return chunk.start, chunk.num_new_tokens


def test_second_request_of_a_group_starts_after_the_shared_blocks() -> None:
    s = make()
    assert s.memory is not None
    kv = s.memory.kv
    a = Request("a", 0.0, 12, 4, block_hashes=(*SHARED, 201))
    assert first_chunk(s, a, 0.0) == (0, 12)
    assert (s.stats.num_prefix_query_tokens, s.stats.num_prefix_hit_tokens) == (12, 0)
    b = Request("b", 1.0, 12, 4, block_hashes=(*SHARED, 301))
    s.add_request(b, 1.0)
    out = s.schedule(1.0)
    chunk = next(c for c in out.chunks if c.request_id == "b")
    assert (chunk.start, chunk.num_new_tokens, chunk.samples) == (8, 4, True)  # 2 hits x 4 tokens
    a_table, b_table = kv.block_table("a"), kv.block_table("b")
    assert b_table[:2] == a_table[:2] and b_table[2] != a_table[2]
    assert [kv.pool.ref_count(blk) for blk in b_table] == [2, 2, 1]
    assert kv.num_used_blocks == 5  # a: 4 (its decode of position 12 took one), b: 1 own block
    s.update(out, sampled(out), 2.0)
    check_invariants(s)
    assert (s.stats.num_prefix_query_tokens, s.stats.num_prefix_hit_tokens) == (24, 8)
    assert s.stats.prefix_hit_rate == 8 / 24
    now = 2.0
    while s.has_unfinished():
        step(s, now)
        now += 1.0
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    assert kv.num_used_blocks == 0


def test_a_whole_prompt_hit_still_computes_its_last_block() -> None:
    s = make()
    first_chunk(s, Request("a", 0.0, 8, 4, block_hashes=SHARED), 0.0)
    c = Request("c", 1.0, 8, 2, block_hashes=SHARED)
    assert first_chunk(s, c, 1.0) == (4, 4)  # hits are whole blocks short of the last token (vLLM)
    assert s.stats.num_prefix_hit_tokens == 4 and s.stats.num_prefix_query_tokens == 16
    assert c.num_output_tokens == 1


def test_only_the_leading_run_of_hashes_hits() -> None:
    s = make()
    first_chunk(s, Request("a", 0.0, 8, 4, block_hashes=SHARED), 0.0)
    d = Request("d", 1.0, 8, 2, block_hashes=(999, SHARED[1]))
    assert first_chunk(s, d, 1.0) == (0, 8)
    e = Request("e", 2.0, 12, 2, block_hashes=(SHARED[0], 998, SHARED[1]))  # (d cached 999 meanwhile)
    assert first_chunk(s, e, 2.0) == (4, 8)
    assert s.stats.num_prefix_hit_tokens == 4


def test_blocks_of_a_finished_request_stay_cached_and_are_reused() -> None:
    s = make()
    assert s.memory is not None
    kv = s.memory.kv
    a = Request("a", 0.0, 8, 1, block_hashes=SHARED)
    first_chunk(s, a, 0.0)
    assert a.is_finished and kv.num_used_blocks == 0  # freed, still cached
    b = Request("b", 1.0, 9, 1, block_hashes=SHARED)
    s.add_request(b, 1.0)
    out = s.schedule(1.0)
    assert out.chunks[0][1:3] == (8, 1)
    assert [kv.pool.ref_count(blk) for blk in kv.block_table("b")] == [1, 1, 1]
    s.update(out, sampled(out), 2.0)
    check_invariants(s)


def test_no_hits_and_no_counts_without_prefix_caching() -> None:
    s = make(caching=False)
    first_chunk(s, Request("a", 0.0, 8, 4, block_hashes=SHARED), 0.0)
    assert first_chunk(s, Request("b", 1.0, 8, 2, block_hashes=SHARED), 1.0) == (0, 8)
    assert (s.stats.num_prefix_query_tokens, s.stats.num_prefix_hit_tokens) == (0, 0)
    assert s.stats.prefix_hit_rate is None


def test_a_request_readmitted_after_recompute_starts_after_its_cached_blocks() -> None:
    """a and b share 2 blocks of 2 tokens; with 6 blocks b (the newest) is preempted at t=4 (it
    had computed 6 positions) and comes back at t=8, after a finished, onto the shared blocks a
    left cached (a's growth evicted b's own output block)."""
    s = make(num_blocks=6, block_size=2, budget=32)
    assert s.memory is not None
    kv = s.memory.kv
    a = Request("a", 0.0, 4, 8, block_hashes=SHARED)
    b = Request("b", 1.0, 4, 8, block_hashes=SHARED)
    s.add_request(a, 0.0)
    step(s, 0.0)
    s.add_request(b, 1.0)
    out = step(s, 1.0)
    assert [(c.request_id, c.start) for c in out.chunks] == [("a", 4), ("b", 2)]  # whole blocks short of 4 tokens
    assert (s.stats.num_prefix_query_tokens, s.stats.num_prefix_hit_tokens) == (8, 2)
    preempted_at = None
    now = 2.0
    while s.has_unfinished():
        out = s.schedule(now)
        if out.preempted_ids:
            assert out.preempted_ids == ("b",) and preempted_at is None
            preempted_at = now
        b_chunk = next((c for c in out.chunks if c.request_id == "b"), None)
        if preempted_at is not None and b_chunk is not None and b.timeline.scheduled_ts[-1] == now:
            assert (b_chunk.start, b_chunk.num_new_tokens) == (4, 3)  # after 2 cached blocks, to 3 outputs
            assert kv.block_table("b")[:2] == (0, 1)  # the cached blocks are shared again ...
        s.update(out, sampled(out), now + 1.0)
        check_invariants(s)
        now += 1.0
    assert preempted_at == 4.0 and b.timeline.scheduled_ts == [1.0, 8.0]
    assert (s.stats.num_prefix_query_tokens, s.stats.num_prefix_hit_tokens) == (8, 2)  # ... but not counted
    assert s.stats.num_recomputed_tokens == 2  # b had computed 6 positions, 4 of them cached
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH


def test_a_request_that_skips_reading_the_cache_computes_every_position() -> None:
    """`skip_reading_prefix_cache` (prompt logprobs): no hit, though its blocks are cached for others."""
    s = make()
    a = Request("a", 0.0, 12, 4, block_hashes=(*SHARED, 201))
    assert first_chunk(s, a, 0.0) == (0, 12)
    b = Request("b", 1.0, 12, 4, block_hashes=(*SHARED, 301), skip_reading_prefix_cache=True)
    assert first_chunk(s, b, 1.0) == (0, 12)
    c = Request("c", 2.0, 16, 4, block_hashes=(*SHARED, 301, 401))  # b's own third block was cached
    assert first_chunk(s, c, 2.0) == (12, 4)
