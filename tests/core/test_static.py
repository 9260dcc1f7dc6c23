"""StaticScheduler: prompt padding to the longest, one padding token per idle slot per decode
step, and the batch barrier (arrivals wait for the whole batch)."""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.core import (
    FinishReason,
    RequestStatus,
    SchedulerConfig,
    StaticScheduler,
    check_invariants,
    seed_config,
)

from .drive import admit, step


@pytest.mark.parametrize("sample_on_prefill", [False, True])
def test_prompt_padding_and_idle_slots(sample_on_prefill: bool) -> None:
    s = StaticScheduler(dataclasses.replace(seed_config(), sample_on_prefill=sample_on_prefill))
    a, b, c = admit(s, "a", 0, 4, 3), admit(s, "b", 0, 2, 1), admit(s, "c", 0, 1, 2)
    outs = []
    now = 0.0
    while s.has_unfinished():
        outs.append(step(s, now))
        now += 1
    prefill = outs[0]
    assert prefill.num_prefill_tokens == 7 and prefill.num_padding_tokens == 5  # 3 prompts padded to 4
    assert all(ch.samples == sample_on_prefill for ch in prefill.chunks)
    decodes = outs[1:]
    assert all(ch.num_new_tokens == 1 and not ch.is_prefill for out in decodes for ch in out.chunks)
    # every decode step computes one token per batch slot: live members plus idle ones
    assert all(out.num_batched_tokens + out.num_padding_tokens == 3 for out in decodes)
    # seed: b's 1 token comes from the first decode; engine: the prefill already sampled it
    assert [out.num_padding_tokens for out in decodes] == ([1, 2] if sample_on_prefill else [0, 1, 2])
    assert sum(out.num_padding_tokens for out in outs) == 8
    assert [r.num_output_tokens for r in (a, b, c)] == [3, 1, 2]
    assert all(r.finish_reason is FinishReason.LENGTH for r in (a, b, c))


def test_equal_prompts_have_no_prompt_padding() -> None:
    s = StaticScheduler(seed_config())
    admit(s, "a", 0, 3, 1)
    admit(s, "b", 0, 3, 1)
    assert step(s, 0).num_padding_tokens == 0


def test_batch_barrier() -> None:
    s = StaticScheduler(seed_config())
    a = admit(s, "a", 0, 4, 5)
    b = admit(s, "b", 0, 2, 2)
    step(s, 0)
    step(s, 1)
    late = admit(s, "late", 2, 1, 1)  # arrives while the batch runs; a free slot does not let it in
    now = 2.0
    while a.status is RequestStatus.RUNNING:
        out = step(s, now)
        assert "late" not in [ch.request_id for ch in out.chunks]
        assert late.status is RequestStatus.WAITING
        now += 1
    assert b.timeline.finished_ts == 3.0 and a.timeline.finished_ts == 6.0
    out = step(s, now)
    assert [ch.request_id for ch in out.chunks] == ["late"] and out.num_padding_tokens == 0
    assert late.timeline.scheduled_ts == [6.0]
    assert s.batch == [late]


def test_batch_takes_at_most_max_num_seqs_in_queue_order() -> None:
    s = StaticScheduler(dataclasses.replace(seed_config(), max_num_seqs=2))
    rs = [admit(s, f"r{i}", 0, 1 + i, 1) for i in range(3)]
    out = step(s, 0)
    assert [ch.request_id for ch in out.chunks] == ["r0", "r1"]
    assert out.num_padding_tokens == 1
    assert rs[2].status is RequestStatus.WAITING


def test_no_token_budget_applies() -> None:
    s = StaticScheduler(SchedulerConfig(max_num_batched_tokens=4, chunked_prefill=False))
    a = admit(s, "a", 0, 10, 1)  # bigger than the token budget: static still runs it whole
    out = step(s, 0)
    assert out.num_batched_tokens == 10 and a.finish_reason is FinishReason.LENGTH


def test_cancelled_member_leaves_an_idle_slot() -> None:
    s = StaticScheduler(seed_config())
    admit(s, "a", 0, 2, 4)
    b = admit(s, "b", 0, 2, 4)
    step(s, 0)
    assert s.cancel("b", 1.5)
    check_invariants(s)
    out = step(s, 2)
    assert [ch.request_id for ch in out.chunks] == ["a"]
    assert out.num_padding_tokens == 1 and out.finished_ids == ("b",)
    assert b.finish_reason is FinishReason.CANCELLED and b.num_output_tokens == 0


def test_empty_scheduler_schedules_nothing() -> None:
    s = StaticScheduler(seed_config())
    out = s.schedule(0)
    assert out.is_empty and out.num_padding_tokens == 0
    check_invariants(s)
