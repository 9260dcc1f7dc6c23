"""Steps read from the outside (`contbatch.observe.steps`): on observations the simulator made,
every timed step is a real step, with its exact duration and content; what cannot be known from
the chunks (a pending prompt, a chunk carrying two steps' tokens) is left untimed."""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.core.status import FinishReason
from contbatch.observe.record import ObservedRequest, ObservedRun
from contbatch.observe.steps import clusters, step_totals, timed_steps
from contbatch.sim.costs.profile import speeds_by_kind, whole_speed
from contbatch.traces import TraceRequest
from tests.observe.test_fit_math import CONFIG, TRUE, observed_run, probe_runs

BUDGET = CONFIG.max_num_batched_tokens


def test_every_timed_step_lasts_what_the_cost_of_its_content_says() -> None:
    cost = TRUE.cost()
    steps = [step for run in probe_runs() for step in timed_steps(run, BUDGET)]
    assert len(steps) > 200 and any(s.out.num_prefill_tokens for s in steps)
    assert any(s.out.num_prefill_tokens and s.out.num_decode_tokens for s in steps)  # a prefill beside decodes
    for step in steps:
        assert step.duration_s == pytest.approx(cost.step_time(step.out), rel=1e-9)


def test_a_run_at_another_speed_reads_as_that_speed_for_both_kinds() -> None:
    open_run = probe_runs()[-1]
    specs = [TraceRequest(r.request_id, r.send_ts, r.num_prompt_tokens, r.max_tokens) for r in open_run.requests]
    slow = observed_run("open-0.50", "open", specs, TRUE.scaled(1.25))
    totals = step_totals(slow, TRUE.cost(), BUDGET)
    assert speeds_by_kind(totals) == pytest.approx((1.25, 1.25)) and whole_speed(totals) == pytest.approx(1.25)


def _request(rid: str, send: float, chunks: tuple[float, ...]) -> ObservedRequest:
    counts = (1,) * len(chunks)
    return ObservedRequest(rid, send, send, 8, sum(counts), chunks, counts, chunks[-1], FinishReason.LENGTH, 200)


def test_chunks_of_one_step_arrive_together_and_a_request_never_twice_in_one() -> None:
    run = ObservedRun("r", "open", {}, (
        _request("a", 0.0, (0.100, 0.110, 0.120)),
        _request("b", 0.0, (0.1005, 0.1102, 0.1201)),  # jitter well under the 10 ms steps
    ))  # fmt: skip
    found = clusters(run)
    assert [sorted(c.members) for c in found] == [[0, 1]] * 3
    steps = timed_steps(run, BUDGET)
    assert [round(s.duration_s, 6) for s in steps] == [0.01, 0.01]
    assert [(s.out.num_decode_tokens, s.out.num_context_tokens) for s in steps] == [(2, 18), (2, 20)]


def test_what_cannot_be_known_from_outside_is_not_timed() -> None:
    base = [_request("a", 0.0, (0.10, 0.11, 0.12, 0.13, 0.14))]
    assert len(timed_steps(ObservedRun("r", "open", {}, tuple(base)), BUDGET)) == 4
    # a request sent at 0.105 with its first token only at 0.13: its prompt may have been split
    # over the steps ending at 0.12 and 0.13; one sent at 0.115 joined the step ending at 0.13 whole
    pending = ObservedRun("r", "open", {}, (*base, _request("b", 0.105, (0.131, 0.141))))
    assert [round(s.duration_s, 3) for s in timed_steps(pending, BUDGET)] == [0.01, 0.01]
    assert not any(s.out.num_prefill_tokens for s in timed_steps(pending, BUDGET))
    joined = ObservedRun("r", "open", {}, (*base, _request("b", 0.115, (0.131, 0.141))))
    assert [s.out.num_prefill_tokens for s in timed_steps(joined, BUDGET)] == [0, 0, 8, 0]
    # a chunk that carried two tokens (two steps read at once) leaves both its steps untimed
    merged = ObservedRun("r", "open", {}, (dataclasses.replace(base[0], chunk_ts=(0.10, 0.11, 0.13, 0.14),
                                                               chunk_tokens=(1, 1, 2, 1)),))  # fmt: skip
    assert [round(s.duration_s, 3) for s in timed_steps(merged, BUDGET)] == [0.01]
    # a step after such a chunk is known again, at the context its tokens so far make (8 + 4)
    later = dataclasses.replace(base[0], chunk_ts=(0.10, 0.11, 0.12, 0.13), chunk_tokens=(1, 2, 1, 1))
    assert [(round(s.duration_s, 3), s.out.num_context_tokens)
            for s in timed_steps(ObservedRun("r", "open", {}, (later,)), BUDGET)] == [(0.01, 12)]  # fmt: skip


def test_steps_read_at_once_by_a_stalled_client_are_not_timed() -> None:
    """Two clusters closer than any step (apart only because a request has a chunk in both) were
    read at once, late: the steps that begin or end at either are not timed (one would read 0.5 ms,
    the one before 19.5 ms, where 10 ms ran)."""
    stalled = ObservedRun("r", "open", {}, (_request("a", 0.0, (0.10, 0.11, 0.1295, 0.13, 0.14, 0.15)),))
    found = clusters(stalled)
    assert len(found) == 6 and [c.clean for c in found] == [True, True, False, False, True, True]
    assert [round(s.duration_s, 3) for s in timed_steps(stalled, BUDGET)] == [0.01, 0.01]  # to 0.11 and to 0.15
    on_time = ObservedRun("r", "open", {}, (_request("a", 0.0, (0.10, 0.11, 0.12, 0.13, 0.14, 0.15)),))
    assert [round(s.duration_s, 3) for s in timed_steps(on_time, BUDGET)] == [0.01] * 5


def test_a_request_seen_without_any_chunk_hides_the_steps_it_ran_in_until_it_ended() -> None:
    """A request answered 200 to `length` whose tokens decoded to no text (it happened: transformers
    serve, one prompt of the held-out plan) ran unseen: the steps of its life are not timed, and
    the replay runs it with its `max_tokens`."""
    from contbatch.observe.replay import run_trace

    base = _request("a", 0.0, (0.10, 0.11, 0.12, 0.13, 0.14, 0.15))
    unseen = ObservedRequest("u", 0.105, 0.105, 8, 5, (), (), 0.125, FinishReason.LENGTH, 200)
    run = ObservedRun("r", "open", {}, (base, unseen))
    assert [round(s.duration_s, 3) for s in timed_steps(run, BUDGET)] == [0.01, 0.01, 0.01]  # 0.11, 0.14, 0.15
    trace = run_trace(run)
    assert trace is not None
    assert [(r.request_id, r.num_output_tokens) for r in trace.requests] == [("a", 6), ("u", 5)]
    failed = dataclasses.replace(unseen, finish=FinishReason.ERROR, status=500)
    assert [r.request_id for r in run_trace(dataclasses.replace(run, requests=(base, failed))).requests] == ["a"]
