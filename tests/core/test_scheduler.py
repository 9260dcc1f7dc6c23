"""ContinuousScheduler stepped by hand, with `check_invariants` after every call.

Covers: rejection at admission, cancel of waiting / running / in-flight requests, strict order
versus `skip_blocked`, `max_num_seqs`, chunked prefill under the budget, finished_ids reporting,
and the executor's reason (stop) winning over length.
"""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    RequestStatus,
    SchedulerBase,
    SchedulerConfig,
    StaticScheduler,
    StepResult,
    TimelineError,
    check_invariants,
    seed_config,
)

from .drive import add, run_to_end, sampled, scheduled_ids, step

ENGINE = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=None, chunked_prefill=False)


# -- rejection ----------------------------------------------------------------------------------
def test_prompt_over_budget_without_chunking_is_rejected_at_once() -> None:
    s = ContinuousScheduler(ENGINE)
    ok = add(s, "ok", 0.0, 3, 2)
    big = Request("big", 0.0, 9, 1)
    decision = s.add_request(big, 0.5)
    assert not decision and decision.reject_kind == "token_budget" and decision.reason == big.finish_detail
    assert big.status is RequestStatus.FINISHED and big.finish_reason is FinishReason.REJECTED
    assert "9" in big.finish_detail and "8" in big.finish_detail
    assert big.timeline.finish_reason is FinishReason.REJECTED and big.timeline.finished_ts == 0.5
    assert not big.timeline.scheduled_ts and "big" not in s.requests
    out = step(s, 1.0)
    assert out.finished_ids == ("big",)  # reported once, in the next output
    assert scheduled_ids(out) == ["ok"]
    run_to_end(s, 2.0)
    assert ok.finish_reason is FinishReason.LENGTH and ok.num_output_tokens == 2
    assert big.num_output_tokens == 0


def test_prompt_over_budget_with_chunking_runs_in_chunks() -> None:
    s = ContinuousScheduler(dataclasses.replace(ENGINE, chunked_prefill=True))
    big = add(s, "big", 0.0, 20, 2)
    sizes = [step(s, float(t)).num_batched_tokens for t in range(3)]
    assert sizes == [8, 8, 4]
    assert big.num_output_tokens == 1 and big.timeline.token_ts == [3.0]
    run_to_end(s, 3.0)
    assert big.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("cls", [ContinuousScheduler, StaticScheduler])
def test_over_max_model_len_is_rejected(chunked: bool, cls: type[SchedulerBase]) -> None:
    s = cls(dataclasses.replace(ENGINE, chunked_prefill=chunked, max_model_len=10))
    fits = add(s, "fits", 0.0, 6, 4)  # exactly 10
    over = add(s, "over", 0.0, 6, 5)
    assert over.finish_reason is FinishReason.REJECTED and "max_model_len" in over.finish_detail
    assert fits.status is RequestStatus.WAITING
    run_to_end(s, 0.0)
    assert fits.finish_reason is FinishReason.LENGTH and fits.num_output_tokens == 4


def test_duplicate_id_is_refused() -> None:
    s = ContinuousScheduler(ENGINE)
    add(s, "x", 0.0, 1, 1)
    with pytest.raises(ValueError, match="already"):
        s.add_request(Request("x", 0.0, 1, 1), 0.0)


# -- cancel ---------------------------------------------------------------------------------------
def test_cancel_waiting_request() -> None:
    s = ContinuousScheduler(ENGINE)
    a = add(s, "a", 0.0, 2, 3)
    assert s.cancel("a", 0.5)
    check_invariants(s)
    assert a.finish_reason is FinishReason.CANCELLED and a.timeline.finished_ts == 0.5
    assert not s.waiting and not s.has_unfinished()
    assert not s.cancel("a", 0.6)  # finished already
    assert not s.cancel("nobody", 0.6)
    out = s.schedule(1.0)
    assert out.is_empty and out.finished_ids == ("a",)


def test_cancel_running_request_keeps_its_partial_output() -> None:
    s = ContinuousScheduler(ENGINE)
    a = add(s, "a", 0.0, 2, 5)
    b = add(s, "b", 0.0, 2, 5)
    step(s, 0.0)
    step(s, 1.0)
    assert a.num_output_tokens == 2 and a.status is RequestStatus.RUNNING
    assert s.cancel("a", 2.5)
    check_invariants(s)
    assert a not in s.running and a.finish_reason is FinishReason.CANCELLED
    assert a.timeline.token_ts == [1.0, 2.0] and a.timeline.finished_ts == 2.5
    out = step(s, 3.0)
    assert scheduled_ids(out) == ["b"] and out.finished_ids == ("a",)
    run_to_end(s, 4.0)
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 5


def test_tokens_of_a_step_in_flight_are_dropped_for_a_cancelled_request() -> None:
    s = ContinuousScheduler(ENGINE)
    a = add(s, "a", 0.0, 2, 5)
    b = add(s, "b", 0.0, 2, 5)
    step(s, 0.0)
    out = s.schedule(1.0)
    assert scheduled_ids(out) == ["a", "b"]
    assert s.cancel("a", 1.5)  # while its step runs
    result = StepResult(
        sampled_token_ids={"a": (0,), "b": (0,)},
        finished={"a": FinishReason.STOP},  # ignored too: a is finished already
    )
    done = s.update(out, result, 2.0)
    check_invariants(s)
    assert done == []
    assert a.finish_reason is FinishReason.CANCELLED and a.timeline.finished_ts == 1.5
    assert a.num_output_tokens == 1 and a.timeline.token_ts == [1.0]
    assert b.num_output_tokens == 2 and b.timeline.token_ts == [1.0, 2.0]


# -- queue order ----------------------------------------------------------------------------------
@pytest.mark.parametrize("skip", [False, True])
def test_blocked_head_blocks_only_in_strict_order(skip: bool) -> None:
    s = ContinuousScheduler(dataclasses.replace(ENGINE, skip_blocked=skip))
    add(s, "r", 0.0, 8, 4)  # fills the whole first step, then decodes 1 token per step
    assert scheduled_ids(step(s, 0.0)) == ["r"]
    head = add(s, "head", 1.0, 8, 1)  # needs the whole budget: blocked while r decodes
    small = add(s, "small", 1.0, 2, 1)
    out = step(s, 1.0)
    if skip:
        assert scheduled_ids(out) == ["r", "small"]
        assert small.status is RequestStatus.FINISHED
    else:
        assert scheduled_ids(out) == ["r"]
        assert small.status is RequestStatus.WAITING
    assert head.status is RequestStatus.WAITING
    run_to_end(s, 2.0)
    assert head.finish_reason is small.finish_reason is FinishReason.LENGTH
    if not skip:
        assert head.timeline.scheduled_ts[0] <= small.timeline.scheduled_ts[0]


def test_waiting_requests_are_admitted_in_arrival_order() -> None:
    s = ContinuousScheduler(dataclasses.replace(ENGINE, max_num_batched_tokens=100))
    for i in range(5):
        add(s, f"r{i}", 0.0, 3, 2)
    assert scheduled_ids(step(s, 0.0)) == [f"r{i}" for i in range(5)]
    assert [r.request_id for r in s.running] == [f"r{i}" for i in range(5)]


# -- budgets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ContinuousScheduler, StaticScheduler])
def test_max_num_seqs_is_respected(cls: type[SchedulerBase]) -> None:
    s = cls(dataclasses.replace(ENGINE, max_num_batched_tokens=64, max_num_seqs=2))
    requests = [add(s, f"r{i}", 0.0, 2, 2 + i) for i in range(5)]
    now = 0.0
    while s.has_unfinished():
        out = step(s, now)
        assert len(out.chunks) <= 2 and len(s.running) <= 2
        now += 1.0
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert requests[2].timeline.scheduled_ts[0] >= requests[0].timeline.finished_ts


def test_decodes_beyond_the_budget_wait_for_the_next_step() -> None:
    s = ContinuousScheduler(seed_config(2))
    requests = [add(s, f"r{i}", 0.0, 1, 3) for i in range(3)]
    assert scheduled_ids(step(s, 0.0)) == ["r0", "r1"]  # two prompts of 1 fill the budget
    out = step(s, 1.0)
    assert scheduled_ids(out) == ["r0", "r1"]  # two decodes; r2 still waits
    assert out.num_batched_tokens == 2
    run_to_end(s, 2.0)
    assert all(r.num_output_tokens == 3 for r in requests)


def test_engine_semantics_first_token_at_the_end_of_the_prefill_step() -> None:
    s = ContinuousScheduler(ENGINE)
    a = add(s, "a", 0.0, 5, 3)
    out = step(s, 0.0)
    assert out.chunks[0].samples and out.num_prefill_tokens == 5
    assert a.timeline.token_ts == [1.0]
    run_to_end(s, 1.0)
    assert a.timeline.token_ts == [1.0, 2.0, 3.0] and a.timeline.finished_ts == 3.0


def test_seed_semantics_first_token_one_step_after_the_prefill() -> None:
    s = ContinuousScheduler(seed_config())
    a = add(s, "a", 0.0, 5, 3)
    out = step(s, 0.0)
    assert not out.chunks[0].samples and a.num_output_tokens == 0
    run_to_end(s, 1.0)
    assert a.timeline.token_ts == [2.0, 3.0, 4.0]


# -- the executor's answer ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_output", [1, 4])
def test_executor_stop_wins_over_length(max_output: int) -> None:
    s = ContinuousScheduler(ENGINE)
    a = add(s, "a", 0.0, 3, max_output)
    out = s.schedule(0.0)
    result = StepResult(sampled_token_ids={"a": (7,)}, finished={"a": FinishReason.STOP})
    done = s.update(out, result, 1.0)
    check_invariants(s)
    assert done == [a]
    assert a.finish_reason is FinishReason.STOP and a.timeline.finish_reason is FinishReason.STOP
    assert a.output_token_ids == [7] and a.timeline.token_ts == [1.0]
    assert not s.running and not s.has_unfinished()


def test_sampled_tokens_beyond_the_maximum_are_cut() -> None:
    s = ContinuousScheduler(ENGINE)
    a = add(s, "a", 0.0, 3, 2)
    out = s.schedule(0.0)
    s.update(out, StepResult(sampled_token_ids={"a": (1, 2, 3)}), 1.0)
    check_invariants(s)
    assert a.output_token_ids == [1, 2] and a.finish_reason is FinishReason.LENGTH


def test_a_sampling_chunk_without_a_token_is_an_error() -> None:
    s = ContinuousScheduler(ENGINE)
    add(s, "a", 0.0, 3, 2)
    out = s.schedule(0.0)
    with pytest.raises(ValueError, match="no sampled token"):
        s.update(out, StepResult(), 1.0)


def test_finished_ids_are_reported_once() -> None:
    s = ContinuousScheduler(ENGINE)
    add(s, "a", 0.0, 3, 1)
    add(s, "b", 0.0, 3, 2)
    assert step(s, 0.0).finished_ids == ()
    assert step(s, 1.0).finished_ids == ("a",)
    assert s.schedule(2.0).finished_ids == ("b",)
    assert s.schedule(3.0).finished_ids == ()
    assert s.num_finished == 2


# -- regressions: bugs found by these tests and fixed ------------------------------------------
def test_a_reused_id_does_not_receive_the_tokens_of_a_cancelled_step() -> None:
    s = ContinuousScheduler(ENGINE)
    add(s, "x", 0.0, 2, 5)
    out = s.schedule(0.0)
    assert s.cancel("x", 0.5)
    again = Request("x", 0.6, 6, 3)
    try:
        s.add_request(again, 0.6)
    except ValueError:
        return  # refusing the id while its step is in flight is a fix too
    s.update(out, sampled(out), 1.0)
    assert again.num_output_tokens == 0 and again.num_computed_tokens == 0
    assert again.timeline.token_ts == []
    check_invariants(s)


def test_a_refused_cancel_leaves_the_scheduler_unchanged() -> None:
    s = ContinuousScheduler(ENGINE)
    a = add(s, "a", 0.0, 2, 5)
    step(s, 0.0)  # a's first token at t=1
    with pytest.raises(TimelineError):
        s.cancel("a", 0.5)  # earlier than its last event
    check_invariants(s)  # InvariantError is an AssertionError
    assert a.status is RequestStatus.RUNNING and a in s.running and a.finish_reason is None
