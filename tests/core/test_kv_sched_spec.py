"""Speculative-decoding accounting with a paged-KV budget, stepped by hand.

A decode chunk carries the newest token plus up to k drafts (`num_speculative_tokens`), fewer
when the output limit is near or the token budget is tight. The executor answers 1 + accepted
drafts tokens; the request's computed tokens advance by that many and the KV blocks of the
rejected drafts are given back (`check_invariants` after every `update` checks blocks ==
computed tokens). Stats count drafts verified and accepted.
"""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    SchedulerConfig,
    StepResult,
    check_invariants,
)
from contbatch.core.config import ConfigError, KVConfig

from .drive import accept_all, accept_none, held


def make(k: int = 3, budget: int = 32, block_size: int = 2, admission: str = "optimistic") -> ContinuousScheduler:
    kv = KVConfig(block_size=block_size, num_blocks=64, watermark=0.0, admission=admission)
    return ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=budget, num_speculative_tokens=k, kv=kv))


def test_all_drafts_accepted_commit_k_plus_one_tokens_a_step() -> None:
    s = make(k=3)
    a = Request("a", 0.0, 4, 10)
    s.add_request(a, 0.0)
    sizes, committed = [], []
    now = 0.0
    while s.has_unfinished():
        out = s.schedule(now)
        (chunk,) = out.chunks
        sizes.append((chunk.start, chunk.num_new_tokens, chunk.is_prefill))
        before = a.num_output_tokens
        s.update(out, accept_all(out), now + 1.0)
        check_invariants(s)
        committed.append(a.num_output_tokens - before)
        now += 1.0
    assert sizes == [(0, 4, True), (4, 4, False), (8, 4, False), (12, 1, False)]  # room 0 at the end
    assert committed == [1, 4, 4, 1]
    assert a.timeline.token_counts == [1, 4, 4, 1] and a.timeline.token_ts == [1.0, 2.0, 3.0, 4.0]
    assert (s.stats.num_draft_tokens, s.stats.num_accepted_draft_tokens) == (6, 6)
    assert s.stats.draft_acceptance_rate == 1.0
    assert a.finish_reason is FinishReason.LENGTH and a.num_output_tokens == 10


def test_no_draft_accepted_commits_one_token_and_rolls_the_kv_back() -> None:
    s = make(k=3, block_size=2)
    a = Request("a", 0.0, 4, 10)
    s.add_request(a, 0.0)
    out = s.schedule(0.0)
    s.update(out, accept_none(out), 1.0)
    check_invariants(s)
    sizes = []
    now = 1.0
    while s.has_unfinished():
        out = s.schedule(now)
        (chunk,) = out.chunks
        sizes.append(chunk.num_new_tokens)
        assert held(s, "a") == -(-(chunk.start + chunk.num_new_tokens) // 2)  # drafts hold blocks in the step
        s.update(out, accept_none(out), now + 1.0)
        check_invariants(s)
        assert a.num_computed_tokens == chunk.start + 1  # only the newest token's KV is kept
        if not a.is_finished:
            assert held(s, "a") == -(-a.num_computed_tokens // 2)  # ... and the drafts' blocks are back
        now += 1.0
    # outputs 1..9 before each decode; drafts limited by the room left: min(3, 10 - out - 1)
    assert sizes == [4, 4, 4, 4, 4, 4, 3, 2, 1]
    assert a.timeline.token_counts == [1] * 10
    assert (s.stats.num_draft_tokens, s.stats.num_accepted_draft_tokens) == (3 * 6 + 2 + 1, 0)
    assert s.stats.draft_acceptance_rate == 0.0


def test_rollback_frees_whole_blocks_only() -> None:
    s = make(k=3, block_size=2)
    a = Request("a", 0.0, 3, 10)
    s.add_request(a, 0.0)
    out = s.schedule(0.0)
    s.update(out, accept_none(out), 1.0)  # computed 3, 2 blocks
    out = s.schedule(1.0)
    assert out.chunks[0][1:3] == (3, 4) and held(s, "a") == 4  # positions 3..6
    s.update(out, accept_none(out), 2.0)
    check_invariants(s)
    assert a.num_computed_tokens == 4 and held(s, "a") == 2


def test_partial_acceptance_keeps_the_accepted_drafts() -> None:
    s = make(k=3)
    a = Request("a", 0.0, 4, 10)
    s.add_request(a, 0.0)
    out = s.schedule(0.0)
    s.update(out, accept_none(out), 1.0)
    out = s.schedule(1.0)
    assert out.chunks[0].num_new_tokens == 4
    s.update(out, StepResult(sampled_token_ids={"a": (0, 0, 0)}), 2.0)  # 2 drafts + 1
    check_invariants(s)
    assert a.num_output_tokens == 4 and a.num_computed_tokens == 4 + 3
    assert (s.stats.num_draft_tokens, s.stats.num_accepted_draft_tokens) == (3, 2)


def test_a_tight_token_budget_trims_the_drafts() -> None:
    s = make(k=3, budget=3)
    a = Request("a", 0.0, 2, 10)
    s.add_request(a, 0.0)
    out = s.schedule(0.0)
    s.update(out, accept_all(out), 1.0)
    out = s.schedule(1.0)
    assert [(c.start, c.num_new_tokens, c.is_prefill) for c in out.chunks] == [(2, 3, False)]  # 1 + 2 drafts
    s.update(out, accept_all(out), 2.0)
    check_invariants(s)
    assert a.num_output_tokens == 4 and s.stats.num_draft_tokens == 2


def test_the_budget_is_shared_in_admission_order() -> None:
    s = make(k=3, budget=6)
    a, b = Request("a", 0.0, 1, 10), Request("b", 0.0, 1, 10)
    for r in (a, b):
        s.add_request(r, 0.0)
    out = s.schedule(0.0)
    s.update(out, accept_all(out), 1.0)
    out = s.schedule(1.0)
    assert [(c.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 4), ("b", 2)]
    s.update(out, accept_all(out), 2.0)
    check_invariants(s)


def test_reserve_keeps_the_whole_reservation_through_speculation() -> None:
    s = make(k=3, block_size=2, admission="reserve")
    a = Request("a", 0.0, 4, 10)  # 14 tokens = 7 blocks, reserved at admission
    s.add_request(a, 0.0)
    now = 0.0
    while s.has_unfinished():
        out = s.schedule(now)
        s.update(out, accept_none(out), now + 1.0)
        check_invariants(s)
        if s.has_unfinished():
            assert held(s, "a") == 7  # no rollback under reserve
        now += 1.0
    assert s.stats.num_preemptions == 0


def test_speculation_needs_engine_semantics() -> None:
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SchedulerConfig(num_speculative_tokens=2, sample_on_prefill=False)
