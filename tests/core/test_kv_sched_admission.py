"""Paged-KV admission modes and never-fit rejection, with the scheduler stepped by hand.

`check_invariants` is called after every `update` (between steps: during a step a running
request already holds the blocks of the chunk it is about to compute, so the "blocks ==
computed tokens" invariant holds only between steps).

Covers: `reserve` (prompt + output limit at admission, never preempts), `optimistic` (first
chunk above the watermark; the newest running request is preempted by recompute when another
cannot grow; nobody is admitted in a step that preempted), `estimate` (fewer admissions when the
ratio is high; the ratio decays to its floor and rises after a preemption), and requests that
can never run (`kv_capacity`, `max_model_len`, `token_budget`).
"""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    RequestStatus,
    SchedulerConfig,
    check_invariants,
)
from contbatch.core.config import KVConfig

from .drive import add, held, run_to_end, sampled, scheduled_ids, step


def kv_sched(budget: int = 64, max_num_seqs: int | None = 256, **kv: object) -> ContinuousScheduler:
    return ContinuousScheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, kv=KVConfig(**kv))  # type: ignore[arg-type]
    )


# -- reserve ------------------------------------------------------------------------------------
def test_reserve_holds_prompt_plus_limit_and_never_preempts() -> None:
    s = kv_sched(block_size=4, num_blocks=10, admission="reserve")
    reqs = [add(s, f"r{i}", 0.0, 6, 6) for i in range(4)]  # 12 tokens = 3 blocks each; only 3 fit
    out = step(s, 0.0)
    assert scheduled_ids(out) == ["r0", "r1", "r2"]
    assert [held(s, r.request_id) for r in reqs] == [3, 3, 3, 0]
    assert reqs[3].status is RequestStatus.WAITING
    now = 1.0
    while s.has_unfinished():
        out = step(s, now)
        now += 1.0
        assert not out.preempted_ids and not out.swapped_out
        for r in s.running:  # the whole reservation at every step, not just the computed tokens
            assert held(s, r.request_id) == 3
    assert s.stats.num_preemptions == 0 and s.stats.num_recompute_preemptions == 0
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 6 for r in reqs)
    assert reqs[3].timeline.scheduled_ts == [6.0]  # after r0..r2 finished at their 6th token (t=6)
    assert s.memory is not None and s.memory.kv.num_used_blocks == 0


def test_optimistic_preempts_on_the_same_workload_reserve_never_does() -> None:
    """The contrast to the test above: optimistic admits all four and must preempt later."""
    s = kv_sched(block_size=4, num_blocks=10, admission="optimistic", watermark=0.0)
    reqs = [add(s, f"r{i}", 0.0, 6, 6) for i in range(4)]
    out = step(s, 0.0)
    assert scheduled_ids(out) == ["r0", "r1", "r2", "r3"]
    assert [held(s, r.request_id) for r in reqs] == [2, 2, 2, 2]  # prompt blocks only
    run_to_end(s, 1.0)
    assert s.stats.num_preemptions > 0
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 6 for r in reqs)


# -- optimistic ---------------------------------------------------------------------------------
def test_optimistic_admits_on_the_first_chunk_above_the_watermark() -> None:
    s = kv_sched(block_size=4, num_blocks=10, watermark=0.2)  # keeps 2 blocks free
    a = add(s, "a", 0.0, 12, 4)  # first chunk: 3 blocks -> 7 free
    b = add(s, "b", 0.0, 20, 4)  # 5 blocks -> 2 free == watermark: admitted
    c = add(s, "c", 0.0, 4, 4)  # 1 block would leave 1 < 2: refused, strict order
    out = step(s, 0.0)
    assert scheduled_ids(out) == ["a", "b"]
    assert (held(s, "a"), held(s, "b"), held(s, "c")) == (3, 5, 0)  # not prompt + limit
    assert c.status is RequestStatus.WAITING
    run_to_end(s, 1.0)
    assert all(r.finish_reason is FinishReason.LENGTH for r in (a, b, c))


def test_optimistic_holds_only_the_first_chunk_of_a_long_prompt() -> None:
    s = kv_sched(budget=8, block_size=4, num_blocks=10, watermark=0.0)
    a = add(s, "a", 0.0, 30, 2)  # 32 tokens at full length = 8 blocks
    out = step(s, 0.0)
    assert out.chunks[0].num_new_tokens == 8 and held(s, "a") == 2
    step(s, 1.0)
    assert held(s, "a") == 4
    run_to_end(s, 2.0)
    assert a.finish_reason is FinishReason.LENGTH


def test_admit_whole_sequence_waits_for_the_whole_prompt_but_holds_the_first_chunk() -> None:
    """vLLM V1's gate: b (a 30-token prompt, 8 blocks) is admitted only when 8 blocks are free
    (a, holding 4 of 11, finished), though its first chunk takes 4; without the gate it starts
    beside a at once."""
    for whole, b_starts in ((True, 2.0), (False, 1.0)):
        s = kv_sched(budget=16, block_size=4, num_blocks=11, watermark=0.0, admit_whole_sequence=whole)
        add(s, "a", 0.0, 14, 2)
        step(s, 0.0)
        b = add(s, "b", 1.0, 30, 2)
        now = 1.0
        while not b.timeline.scheduled_ts:
            step(s, now)
            now += 1.0
        assert b.timeline.scheduled_ts[0] == b_starts and held(s, "b") == 4, whole
        run_to_end(s, now)


def _pressure() -> tuple[ContinuousScheduler, dict[str, Request]]:
    """a, b, c decode in 6 blocks of 2 tokens; at t=3 a needs its third block and the pool is
    full. d waits (max_num_seqs=3)."""
    s = kv_sched(budget=32, max_num_seqs=3, block_size=2, num_blocks=6, watermark=0.0)
    reqs = {rid: add(s, rid, 0.0, 2, 4) for rid in "abcd"}
    for t in range(3):
        assert scheduled_ids(step(s, float(t))) == ["a", "b", "c"]
    return s, reqs


def test_optimistic_preempts_the_newest_by_recompute() -> None:
    s, r = _pressure()
    assert s.memory is not None
    kv = s.memory.kv
    c_blocks = kv.block_table("c")
    assert len(c_blocks) == 2 and r["c"].num_computed_tokens == 4 and kv.num_free_blocks == 0
    out = s.schedule(3.0)
    assert out.preempted_ids == ("c",) and out.swapped_out == ()
    assert scheduled_ids(out) == ["a", "b"]  # d not admitted in a step that preempted, though a seat is free
    assert held(s, "c") == 0  # freed in this very step ...
    assert {kv.block_table("a")[2], kv.block_table("b")[2]} == set(c_blocks)  # ... and reused by a, b
    assert r["c"].status is RequestStatus.PREEMPTED and r["c"].num_computed_tokens == 0
    assert [q.request_id for q in s.waiting] == ["c", "d"]  # to the FRONT of the queue
    assert r["c"].timeline.preempted_ts == [3.0]
    assert (s.stats.num_preemptions, s.stats.num_recompute_preemptions, s.stats.num_swap_outs) == (1, 1, 0)
    s.update(out, sampled(out), 4.0)
    check_invariants(s)
    assert r["a"].finish_reason is FinishReason.LENGTH and r["b"].finish_reason is FinishReason.LENGTH
    assert s.stats.num_recomputed_tokens == 0
    out = step(s, 4.0)
    c_chunk = next(ch for ch in out.chunks if ch.request_id == "c")
    # re-prefill from 0 over prompt + its 3 outputs; the chunk reaching the end samples token 4
    assert (c_chunk.start, c_chunk.num_new_tokens, c_chunk.is_prefill, c_chunk.samples) == (0, 5, True, True)
    assert s.stats.num_recomputed_tokens == 4  # the 4 positions c had computed before
    assert r["c"].finish_reason is FinishReason.LENGTH and r["c"].num_output_tokens == 4
    assert r["c"].timeline.scheduled_ts == [0.0, 4.0]
    run_to_end(s, 5.0)
    assert r["d"].finish_reason is FinishReason.LENGTH
    assert s.stats.num_preemptions == 1


def test_requester_that_is_the_newest_preempts_itself() -> None:
    s = kv_sched(budget=32, block_size=2, num_blocks=4, watermark=0.0)
    a = add(s, "a", 0.0, 4, 3)  # 2 blocks, 3 at its 5th position
    b = add(s, "b", 0.0, 1, 4)  # 1 block; its decode of position 2 needs a 2nd block
    step(s, 0.0)
    step(s, 1.0)
    assert (held(s, "a"), held(s, "b")) == (3, 1)
    out = s.schedule(2.0)
    assert out.preempted_ids == ("b",) and scheduled_ids(out) == ["a"]  # b, the newest, yields its own step
    assert held(s, "b") == 0 and b.num_computed_tokens == 0 and b.status is RequestStatus.PREEMPTED
    s.update(out, sampled(out), 3.0)
    check_invariants(s)
    assert a.finish_reason is FinishReason.LENGTH
    run_to_end(s, 3.0)
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 4


# -- estimate -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("admission", "num_admitted"), [("optimistic", 8), ("estimate", 5)])
def test_estimate_admits_fewer_than_optimistic_when_the_ratio_is_high(admission: str, num_admitted: int) -> None:
    # Each request: 1 block of prompt, 16 outputs to come. Estimate at ratio 0.7 expects
    # round(0.7 * 16) = 11 tokens = 3 more blocks each: the k-th admission (k = 0, 1, ...) needs
    # 1 + 3 blocks beside the 3k already promised, 20 - k - 4 - 3k >= 0 holds for k <= 4.
    s = kv_sched(block_size=4, num_blocks=20, admission=admission, watermark=0.0, estimate_init_ratio=0.7)
    for i in range(8):
        add(s, f"r{i}", 0.0, 4, 16)
    out = step(s, 0.0)
    assert len(out.chunks) == num_admitted
    run_to_end(s, 1.0)


def test_estimate_ratio_decays_per_step_to_its_floor() -> None:
    s = kv_sched(
        block_size=4, num_blocks=64, admission="estimate", estimate_init_ratio=0.7, estimate_decay=0.1,
        estimate_min_ratio=0.2,
    )  # fmt: skip
    assert s.memory is not None
    add(s, "a", 0.0, 4, 12)
    ratios = []
    for t in range(8):
        step(s, float(t))
        ratios.append(s.memory.ratio)
    assert ratios == pytest.approx([0.6, 0.5, 0.4, 0.3, 0.2, 0.2, 0.2, 0.2])


def test_estimate_ratio_rises_after_a_step_that_preempted() -> None:
    s = kv_sched(
        budget=32, max_num_seqs=3, block_size=2, num_blocks=6, watermark=0.0, admission="estimate",
        estimate_init_ratio=0.0, estimate_min_ratio=0.0, estimate_decay=0.01, estimate_bump=0.3,
    )  # fmt: skip
    assert s.memory is not None
    for rid in "abcd":
        add(s, rid, 0.0, 2, 4)
    for t in range(3):  # ratio 0: admits like optimistic (the _pressure scenario)
        step(s, float(t))
        assert s.memory.ratio == 0.0
    out = step(s, 3.0)
    assert out.preempted_ids == ("c",)
    assert s.memory.ratio == pytest.approx(0.3)
    step(s, 4.0)
    assert s.memory.ratio == pytest.approx(0.29)


def test_estimate_ratio_is_capped_at_one() -> None:
    s = kv_sched(
        budget=32, max_num_seqs=3, block_size=2, num_blocks=6, watermark=0.0, admission="estimate",
        estimate_init_ratio=0.0, estimate_min_ratio=0.0, estimate_decay=0.0, estimate_bump=1.0,
    )  # fmt: skip
    assert s.memory is not None
    for rid in "abcd":
        add(s, rid, 0.0, 2, 4)
    run_to_end(s, 0.0)
    assert s.stats.num_preemptions >= 1 and s.memory.ratio == 1.0


# -- never fit ----------------------------------------------------------------------------------
def test_request_that_never_fits_the_cache_is_rejected_at_once() -> None:
    s = kv_sched(block_size=4, num_blocks=4)  # 16 tokens
    fits = add(s, "fits", 0.0, 10, 6)  # exactly 16
    big = Request("big", 0.0, 10, 7)  # 17 tokens = 5 blocks
    decision = s.add_request(big, 0.5)
    assert not decision.queued and decision.reject_kind == "kv_capacity" and decision.reason == big.finish_detail
    check_invariants(s)
    assert big.status is RequestStatus.FINISHED and big.finish_reason is FinishReason.REJECTED
    assert "blocks" in big.finish_detail and "5" in big.finish_detail and "4" in big.finish_detail
    assert big.timeline.finished_ts == 0.5 and not big.timeline.scheduled_ts
    assert s.stats.rejections == {"kv_capacity": 1}
    out = step(s, 1.0)
    assert out.finished_ids == ("big",)
    run_to_end(s, 2.0)
    assert fits.finish_reason is FinishReason.LENGTH and fits.num_output_tokens == 6


@pytest.mark.parametrize("admission", ["reserve", "optimistic", "estimate"])
def test_never_fit_rejection_is_the_same_in_every_admission_mode(admission: str) -> None:
    s = kv_sched(block_size=4, num_blocks=4, admission=admission, watermark=0.0)
    big = add(s, "big", 0.0, 1, 16)  # 17 tokens
    assert big.finish_reason is FinishReason.REJECTED and "KV blocks" in big.finish_detail
    assert s.stats.rejections == {"kv_capacity": 1}


def test_max_model_len_is_checked_before_kv_capacity() -> None:
    s = ContinuousScheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=12, kv=KVConfig(block_size=4, num_blocks=2))
    )
    both = add(s, "both", 0.0, 10, 6)  # over max_model_len and over the cache
    kv_only = add(s, "kv", 0.0, 5, 5)  # 10 <= 12 tokens, but 3 blocks > 2
    assert both.finish_reason is FinishReason.REJECTED and "max_model_len" in both.finish_detail
    assert kv_only.finish_reason is FinishReason.REJECTED and "blocks" in kv_only.finish_detail
    assert s.stats.rejections == {"max_model_len": 1, "kv_capacity": 1}


def test_prompt_over_the_token_budget_without_chunking_is_rejected() -> None:
    s = ContinuousScheduler(
        SchedulerConfig(max_num_batched_tokens=8, chunked_prefill=False, kv=KVConfig(block_size=4, num_blocks=8))
    )
    big = add(s, "big", 0.0, 9, 1)
    ok = add(s, "ok", 0.0, 8, 2)
    assert big.finish_reason is FinishReason.REJECTED and "token budget" in big.finish_detail
    assert s.stats.rejections == {"token_budget": 1}
    run_to_end(s, 0.0)
    assert ok.finish_reason is FinishReason.LENGTH


# -- a lone request is never refused: it fits the pool, or it was rejected ----------------------
# (Both were stalls at commit 974b9fd: `never_fits` ignored the watermark and the estimate's
# rounding; fixed by admitting a request that would run alone without those margins.)
def test_lone_request_that_fits_the_pool_but_not_the_watermark_runs() -> None:
    s = kv_sched(block_size=4, num_blocks=10, watermark=0.1)  # keeps 1 block free
    a = add(s, "a", 0.0, 38, 2)  # 40 tokens = 10 blocks: fits; its 38-token first chunk needs all 10
    b = add(s, "b", 0.0, 4, 2)
    assert a.status is RequestStatus.WAITING  # not rejected up front ...
    out = step(s, 0.0)
    assert scheduled_ids(out) == ["a"]  # ... and admitted alone, below the watermark; b waits behind it
    assert held(s, "a") == 10
    run_to_end(s, 1.0)
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH


def test_the_watermark_still_applies_beside_a_running_request() -> None:
    s = kv_sched(block_size=4, num_blocks=10, watermark=0.2)  # keeps 2 blocks free
    add(s, "a", 0.0, 4, 2)
    step(s, 0.0)
    b = add(s, "b", 1.0, 24, 2)  # a grows to 2 blocks at t=1; b's 6 leave 2 free: admitted
    c = add(s, "c", 1.0, 4, 2)  # 1 block would leave 1 < 2: it waits
    assert scheduled_ids(step(s, 1.0)) == ["a", "b"]
    assert c.status is RequestStatus.WAITING
    run_to_end(s, 2.0)
    assert b.finish_reason is FinishReason.LENGTH and c.finish_reason is FinishReason.LENGTH


def test_estimate_admits_a_lone_request_that_fits_the_pool() -> None:
    s = kv_sched(block_size=4, num_blocks=2, admission="estimate", watermark=0.0)
    a = add(s, "a", 0.0, 5, 3)  # 8 tokens = 2 blocks: fits; estimate wants 2 + blocks(round(0.7 * 3)) = 3
    out = step(s, 0.0)
    assert scheduled_ids(out) == ["a"]
    run_to_end(s, 1.0)
    assert a.finish_reason is FinishReason.LENGTH
