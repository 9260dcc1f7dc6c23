"""Preemption by swap: a victim's KV moves to host blocks and comes back on re-admission.

The scheduler is stepped by hand, `check_invariants` after every `update`. Scenario (`_setup`):
blocks of 2 tokens, 4 device blocks; a (prompt 2, limit 6) and b (prompt 2, limit 4) decode side
by side until, at t=3, a needs its third block with the pool full: b, the newest, is preempted.
"""

from __future__ import annotations

import dataclasses

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
from contbatch.sim.cost import AffineCost

from .drive import accept_all, sampled, scheduled_ids, step


def _setup(num_host_blocks: int, preemption: str = "swap") -> tuple[ContinuousScheduler, Request, Request]:
    kv = KVConfig(block_size=2, num_blocks=4, watermark=0.0, preemption=preemption, num_host_blocks=num_host_blocks)
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=32, kv=kv))
    a, b = Request("a", 0.0, 2, 6), Request("b", 0.0, 2, 4)
    for r in (a, b):
        s.add_request(r, 0.0)
    for t in range(3):
        assert scheduled_ids(step(s, float(t))) == ["a", "b"]
    assert b.num_computed_tokens == 4 and b.num_output_tokens == 3
    return s, a, b


def test_swap_keeps_the_computed_tokens_and_moves_the_blocks() -> None:
    s, a, b = _setup(num_host_blocks=8)
    assert s.memory is not None
    kv = s.memory.kv
    b_blocks = kv.block_table("b")
    assert len(b_blocks) == 2
    out = s.schedule(3.0)
    assert out.preempted_ids == ("b",) and scheduled_ids(out) == ["a"]
    assert out.swapped_out == (("b", b_blocks),) and out.swapped_in == ()
    assert out.num_swapped_blocks == 2
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 4  # kept
    assert kv.is_swapped("b") and kv.num_held_blocks("b") == 0 and kv.num_held_host_blocks("b") == 2
    assert kv.num_free_host_blocks == 6
    assert [r.request_id for r in s.waiting] == ["b"]
    st = s.stats
    assert (st.num_preemptions, st.num_swap_outs, st.num_swapped_out_blocks, st.num_recompute_preemptions) == (
        1, 1, 2, 0,
    )  # fmt: skip
    s.update(out, sampled(out), 4.0)
    check_invariants(s)
    # t=4: b needs 3 device blocks (its 2 plus one for position 4), only 1 is free
    assert scheduled_ids(step(s, 4.0)) == ["a"]
    assert scheduled_ids(step(s, 5.0)) == ["a"]  # a takes its 4th block and finishes
    assert a.finish_reason is FinishReason.LENGTH
    out = s.schedule(6.0)
    assert scheduled_ids(out) == ["b"] and out.swapped_out == ()
    ((rid, new_blocks),) = out.swapped_in
    assert rid == "b" and len(new_blocks) == 2
    assert kv.block_table("b")[:2] == new_blocks and kv.num_held_blocks("b") == 3
    assert not kv.is_swapped("b") and kv.num_free_host_blocks == 8
    chunk = out.chunks[0]
    assert (chunk.start, chunk.num_new_tokens, chunk.is_prefill) == (4, 1, False)  # no recompute
    assert (s.stats.num_swap_ins, s.stats.num_swapped_in_blocks) == (1, 2)
    s.update(out, sampled(out), 7.0)
    check_invariants(s)
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 4
    assert s.stats.num_recomputed_tokens == 0
    assert b.timeline.scheduled_ts == [0.0, 6.0] and b.timeline.preempted_ts == [3.0]
    assert kv.num_used_blocks == 0


@pytest.mark.parametrize("num_host_blocks", [0, 1])
def test_swap_falls_back_to_recompute_when_the_host_pool_is_too_small(num_host_blocks: int) -> None:
    s, _, b = _setup(num_host_blocks=num_host_blocks)
    assert s.memory is not None
    out = s.schedule(3.0)
    assert out.preempted_ids == ("b",) and out.swapped_out == ()
    assert b.num_computed_tokens == 0 and not s.memory.kv.is_swapped("b")
    st = s.stats
    assert (st.num_preemptions, st.num_recompute_preemptions, st.num_swap_outs, st.num_swapped_out_blocks) == (
        1, 1, 0, 0,
    )  # fmt: skip
    s.update(out, sampled(out), 4.0)
    check_invariants(s)
    now = 4.0
    while s.has_unfinished():
        out = step(s, now)
        assert out.swapped_in == ()
        now += 1.0
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 4
    assert s.stats.num_swap_ins == 0 and s.stats.num_recomputed_tokens == 4


def test_swap_and_recompute_preempt_at_the_same_step() -> None:
    """The preemption mode changes what happens to the victim, not when or who."""
    swap, _, _ = _setup(num_host_blocks=8)
    recompute, _, _ = _setup(num_host_blocks=8, preemption="recompute")
    assert swap.schedule(3.0).preempted_ids == recompute.schedule(3.0).preempted_ids == ("b",)


def test_cancelling_a_swapped_out_request_frees_its_host_blocks() -> None:
    s, _, b = _setup(num_host_blocks=8)
    assert s.memory is not None
    out = s.schedule(3.0)
    s.update(out, sampled(out), 4.0)
    assert s.memory.kv.num_held_host_blocks("b") == 2
    assert s.cancel("b", 4.5)
    check_invariants(s)
    assert b.finish_reason is FinishReason.CANCELLED and b.num_output_tokens == 3
    assert "b" not in s.memory.kv and s.memory.kv.num_free_host_blocks == 8


def test_host_blocks_are_not_used_by_recompute_preemption() -> None:
    kv = KVConfig(block_size=2, num_blocks=4, preemption="recompute", num_host_blocks=8)
    s = ContinuousScheduler(SchedulerConfig(kv=kv))
    assert s.memory is not None and s.memory.kv.num_host_blocks == 0


def test_affine_cost_prices_swapped_blocks_if_it_has_such_a_parameter() -> None:
    swap_fields = [f.name for f in dataclasses.fields(AffineCost) if "swap" in f.name]
    if not swap_fields:
        pytest.skip("AffineCost has no swap parameter: swapped blocks are not priced")
    s, _, _ = _setup(num_host_blocks=8)
    out = s.schedule(3.0)
    assert out.num_swapped_blocks == 2
    free = AffineCost(**{name: 0.0 for name in swap_fields})
    priced = AffineCost(**{name: 1.0 for name in swap_fields})
    assert priced.step_time(out) > free.step_time(out)
    if swap_fields == ["swap_ms_per_block"]:  # milliseconds per block moved, either direction
        assert priced.step_time(out) - free.step_time(out) == pytest.approx(2 * 1.0 / 1000.0)
    plain = dataclasses.replace(out, swapped_out=(), swapped_in=())
    assert priced.step_time(plain) == free.step_time(plain)


# -- known bugs ---------------------------------------------------------------------------------
def test_swapped_victim_moves_only_the_blocks_of_its_computed_tokens() -> None:
    # t=4: b (3 tokens), then c, priority 1, grows to 3 blocks for a 2-token speculative decode
    # from position 1, then d cannot grow and the lowest priority running request is c: c is
    # swapped out with 3 blocks though only position 0 is computed (1 block).
    kv = KVConfig(block_size=1, num_blocks=18, watermark=0.0, preemption="swap", num_host_blocks=64,
                  victim="lowest_priority")  # fmt: skip
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=6, num_speculative_tokens=2, kv=kv))
    assert s.memory is not None
    reqs = {}
    for rid, prompt, limit, priority in [("a", 9, 3, 0), ("b", 10, 4, 0), ("c", 1, 3, 1), ("d", 8, 1, 0)]:
        reqs[rid] = Request(rid, 0.0, prompt, limit, priority=priority)
        s.add_request(reqs[rid], 0.0)
    for t in range(10):
        out = s.schedule(float(t))
        for rid, blocks in out.swapped_out:
            assert len(blocks) == s.memory.kv.num_blocks_for(reqs[rid].num_computed_tokens), (t, rid, blocks)
        s.update(out, accept_all(out), t + 1.0)
        check_invariants(s)  # t=5: "'c' holds 3 blocks for 2 tokens"
        if not s.has_unfinished():
            break
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs.values())


def test_prefill_first_never_swaps_out_a_request_admitted_in_the_same_step() -> None:
    kv = KVConfig(block_size=4, num_blocks=4, watermark=0.0, preemption="swap", num_host_blocks=8)
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64, prefill_first=True, kv=kv))
    a = Request("a", 0.0, 4, 8)
    s.add_request(a, 0.0)
    step(s, 0.0)  # a: 1 block, position 4 (its first decode) needs a second one
    b = Request("b", 1.0, 12, 1)  # admitted by the prefill phase into the 3 free blocks
    s.add_request(b, 1.0)
    out = s.schedule(1.0)
    # today b is admitted, then a's decode preempts b (the newest) and swaps out its 3 blocks
    # though nothing of b was ever computed
    assert s.memory is not None
    for rid, blocks in out.swapped_out:
        computed = {"a": a, "b": b}[rid].num_computed_tokens
        assert computed > 0 and len(blocks) == s.memory.kv.num_blocks_for(computed), (rid, blocks, computed)
    s.update(out, sampled(out), 2.0)
    check_invariants(s)  # today: "swapped 'b' has nothing computed"
    now = 2.0
    while s.has_unfinished():
        step(s, now)
        now += 1.0
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
