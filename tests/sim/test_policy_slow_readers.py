"""Streaming backpressure on the built-in `slow-readers` trace (30 % of clients read 5-20 tokens/s),
simulated with the `engine` preset and the `affine` cost, with `output_credits=W`.

- credits alone: after every step no unfinished request has more than W unsent tokens; requests
  pause (paused time > 0) and all finish; generated == sent, nothing is wasted;
- `max_pause` + `pause_action="cancel"`: the requests paused too long end TIMEOUT (finish detail
  names max_pause), each wasting its unsent tokens: more than 0, at most W each (exactly W: a
  request pauses when its W credits are used up);
- `max_pause` + `pause_action="preempt"`: pause preemptions happen (only to slow readers) and
  every request still finishes with all its tokens.

Minimal cases below pin four bugs that used to stall the simulator or miscount waste (all fixed):
float misfire of the pause timer, no wake-up for a pause-preempted request's read, an empty step
after an idle pause preemption, and unread tokens of timed-out requests counted as waste.

Pauses last at most 1 / read rate <= 0.2 s (the client reads one more token by then), so max_pause
must be below 0.2 s to matter.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    SchedulerBase,
    SchedulerConfig,
    SchedulerOutput,
    check_invariants,
    preset_config,
)
from contbatch.core.config import LifecycleConfig
from contbatch.sim import AffineCost, SimResult, UnitCost, simulate
from contbatch.traces import Trace, TraceRequest
from contbatch.traces.scenarios import slow_readers

from .recording import recording

W = 16


class Watch:
    """Records the requests as they are added and, after every step, the largest number of unsent
    tokens of any unfinished request (full invariants every 25 steps: a 6,144-block pool)."""

    def __init__(self, scheduler: SchedulerBase) -> None:
        self.requests: list[Request] = scheduler.handed_over  # type: ignore[attr-defined]  (`recording`)
        self.max_unsent = 0

    def __call__(self, s: SchedulerBase, out: SchedulerOutput, now: float) -> None:
        for r in s.requests.values():
            assert r.num_unsent_tokens <= W, (now, r)
            self.max_unsent = max(self.max_unsent, r.num_unsent_tokens)
        if out.step_id % 25 == 0:
            check_invariants(s)


@functools.cache
def run(max_pause: float | None = None, pause_action: str = "preempt") -> tuple[SimResult, Watch, ContinuousScheduler]:
    lifecycle = LifecycleConfig(output_credits=W, max_pause=max_pause, pause_action=pause_action)
    scheduler = recording(ContinuousScheduler)(dataclasses.replace(preset_config("engine"), lifecycle=lifecycle))
    watch = Watch(scheduler)
    result = simulate(slow_readers(), scheduler, AffineCost(), inspect=watch)
    assert scheduler.memory is not None and scheduler.memory.kv.num_used_blocks == 0
    return result, watch, scheduler


def test_credits_bound_unsent_tokens_and_pause_slow_readers() -> None:
    result, watch, scheduler = run()
    assert watch.max_unsent == W  # the window is used up, never exceeded
    stats = result.run_stats()
    assert stats["generated_tokens"] == sum(r.num_output_tokens for r in slow_readers().requests)
    assert stats["sent_tokens"] == stats["generated_tokens"] and stats["num_unsent_tokens"] == 0
    assert isinstance(stats["paused_time"], float) and stats["paused_time"] > 0
    assert stats["paused_time"] == pytest.approx(sum(r.paused_time for r in watch.requests))
    assert stats["num_pause_preemptions"] == 0
    assert all(t.finish_reason is FinishReason.LENGTH for t in result.timelines)
    # only slow readers pause
    slow = {r.request_id for r in slow_readers().requests if r.read_rate is not None}
    assert {r.request_id for r in watch.requests if r.paused_time > 0} <= slow
    assert scheduler.stats.num_unsent_tokens == 0


def test_max_pause_cancel_times_out_paused_requests_and_wastes_at_most_w_each() -> None:
    # 0.05 used to stall: (since + 0.05) - since < 0.05 in floats (the lifecycle timers now compare
    # now >= since + limit, the very sum next_timer reports)
    result, watch, _ = run(0.05, "cancel")
    timed_out = [r for r in watch.requests if r.finish_reason is FinishReason.TIMEOUT]
    assert timed_out and all("max_pause" in r.finish_detail for r in timed_out)
    slow = {r.request_id for r in slow_readers().requests if r.read_rate is not None}
    assert {r.request_id for r in timed_out} <= slow
    stats = result.run_stats()
    wasted = stats["num_unsent_tokens"]
    assert isinstance(wasted, int) and 0 < wasted <= W * len(timed_out)
    assert wasted == sum(r.num_unsent_tokens for r in timed_out)
    # paused: its W credits used up; a read short of W / 2 free credits leaves it paused
    assert all(W // 2 < r.num_unsent_tokens <= W for r in timed_out)
    assert stats["sent_tokens"] == stats["generated_tokens"] - wasted  # type: ignore[operator]
    assert stats["num_pause_preemptions"] == 0
    others = [r for r in watch.requests if r.finish_reason is not FinishReason.TIMEOUT]
    assert all(r.finish_reason is FinishReason.LENGTH for r in others)


@pytest.mark.parametrize("max_pause", [0.05, 0.1])
def test_max_pause_preempt_preempts_and_every_request_finishes(max_pause: float) -> None:
    result, watch, scheduler = run(max_pause, "preempt")
    assert scheduler.stats.num_pause_preemptions > 0
    assert watch.max_unsent == W
    assert all(t.finish_reason is FinishReason.LENGTH for t in result.timelines)
    assert all(
        r.num_output_tokens == spec.num_output_tokens
        for r, spec in zip(watch.requests, slow_readers().requests, strict=True)
    )
    stats = result.run_stats()
    assert stats["num_unsent_tokens"] == 0 and stats["sent_tokens"] == stats["generated_tokens"]
    assert isinstance(stats["paused_time"], float) and stats["paused_time"] > 0
    # only slow readers are preempted for pausing
    slow = {r.request_id for r in slow_readers().requests if r.read_rate is not None}
    assert {r.request_id for r in watch.requests if r.num_preemptions} <= slow


# -- minimal cases (each used to stall the simulator) --------------------------------------------
def one_reader(read_rate: float, max_pause: float, action: str) -> tuple[Trace, ContinuousScheduler]:
    """Reader "a" (1 credit) and, for the only seat, "b" (2 tokens) from 0.5: a pause preemption
    needs someone waiting."""
    rows = (TraceRequest("a", 0.3, 1, 5, read_rate=read_rate), TraceRequest("b", 0.5, 1, 2))
    lifecycle = LifecycleConfig(output_credits=1, max_pause=max_pause, pause_action=action)
    return Trace("reader", rows, "tick", "hand-built"), ContinuousScheduler(
        SchedulerConfig(max_num_seqs=1, lifecycle=lifecycle)
    )


def test_a_pause_preempted_request_resumes_when_its_client_reads() -> None:
    # a's first token at 1.3: paused at once (1 credit), preempted 0.5 later for b (which waits);
    # b runs 1.8-3.8. a's client has read its token by 3.3: a is readmitted at 3.8 (its second token
    # at 4.8), then, nobody waiting, keeps its KV while paused; its client reads a token every 2
    # ticks (fluid, from its last look): the idle simulator must wake up for each read
    trace, scheduler = one_reader(0.5, 0.5, "preempt")
    result = simulate(trace, scheduler, UnitCost())
    tl, rival = result.timelines
    assert tl.finish_reason is FinishReason.LENGTH and tl.num_output_tokens == 5
    assert rival.finish_reason is FinishReason.LENGTH and rival.scheduled_ts == pytest.approx([1.8])
    assert tl.preempted_ts == pytest.approx([1.8]) and scheduler.stats.num_pause_preemptions == 1
    assert tl.scheduled_ts == pytest.approx([0.3, 3.8])
    assert tl.token_ts == pytest.approx([1.3, 4.8, 6.8, 8.8, 10.8])


def test_a_pause_preemption_does_not_leave_an_admissible_request_waiting() -> None:
    # one seat: "slow" gets its token at 1, is paused (1 credit, client reads 1 token per 8 ticks)
    # and keeps the seat; at 1.25 it is preempted for pausing, which frees the seat for "b" in that
    # very step (only a running request growing by preemption blocks the step's admissions)
    trace = Trace(
        "t", (TraceRequest("slow", 0.0, 1, 2, read_rate=0.125), TraceRequest("b", 0.0, 1, 1)), "tick", "hand-built"
    )
    lifecycle = LifecycleConfig(output_credits=1, max_pause=0.25, pause_action="preempt")
    scheduler = ContinuousScheduler(SchedulerConfig(max_num_seqs=1, lifecycle=lifecycle))
    result = simulate(trace, scheduler, UnitCost())
    slow, b = result.timelines
    assert b.scheduled_ts == [1.25] and b.finish_reason is FinishReason.LENGTH
    assert slow.preempted_ts == [1.25] and slow.scheduled_ts == [0.0, 9.0]  # its client's read at 9
    assert slow.finish_reason is FinishReason.LENGTH and scheduler.stats.num_pause_preemptions == 1


@pytest.mark.parametrize("action", ["cancel", "preempt"])
def test_pause_timer_fires_when_next_timer_says(action: str) -> None:
    # first token at 1.3, paused at once; the client reads 0.01 tokens per tick. In floats
    # (1.3 + 0.2) - 1.3 = 0.19999999999999996 < 0.2: a `now - since >= limit` test misses the timer
    trace, scheduler = one_reader(0.01, 0.2, action)
    result = simulate(trace, scheduler, UnitCost())
    tl = result.timelines[0]
    if action == "cancel":
        assert tl.finish_reason is FinishReason.TIMEOUT and tl.finished_ts == 1.3 + 0.2
        assert tl.token_ts == [1.3] and result.run_stats()["num_unsent_tokens"] == 1
    else:
        assert tl.preempted_ts[0] == 1.3 + 0.2 and scheduler.stats.num_pause_preemptions >= 1
        assert tl.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("with_cancel", [False, True])
def test_a_timed_out_request_wastes_nothing_its_unlimited_client_already_read(with_cancel: bool) -> None:
    # an unlimited reader takes every token as it comes: with timeouts alone the tokens used to be
    # counted as unsent (no client read them), unlike beside a request with a cancel time
    rows = [TraceRequest("a", 0.0, 1, 10)]
    if with_cancel:
        rows.append(TraceRequest("b", 0.0, 1, 2, cancel_ts=100.0))
    scheduler = ContinuousScheduler(SchedulerConfig(lifecycle=LifecycleConfig(request_timeout=5.0)))
    result = simulate(Trace("t", tuple(rows), "tick", "hand-built"), scheduler, UnitCost())
    assert result.timelines[0].finish_reason is FinishReason.TIMEOUT
    assert result.timelines[0].num_output_tokens == 5
    assert result.run_stats()["num_unsent_tokens"] == 0


def test_a_slow_reader_does_not_thrash_under_pause_preemption() -> None:
    """A client reading 1 token/s with 8 credits and max_pause 0.5 (it pauses between reads): it
    used to be preempted before almost every token (292 preemptions, 102,930 recomputed tokens for
    300 outputs). Now alone it keeps its KV, and among 200 other requests it is preempted only
    while they wait, resuming with half its credits free: at most 300 / 4 preemptions."""
    lifecycle = LifecycleConfig(output_credits=8, max_pause=0.5, pause_action="preempt")
    config = dataclasses.replace(preset_config("engine"), lifecycle=lifecycle)
    for others in (0, 200):
        specs = [TraceRequest("slow", 0.0, 200, 300, read_rate=1.0)]
        specs += [TraceRequest(f"o{i}", 0.5 * i, 100, 50) for i in range(others)]
        scheduler = ContinuousScheduler(config)
        result = simulate(Trace("t", tuple(specs), "s", "test"), scheduler, AffineCost())
        stats = result.scheduler_stats
        assert result.timelines[0].finish_reason is FinishReason.LENGTH
        assert all(t.finish_reason is FinishReason.LENGTH for t in result.timelines)
        if not others:
            assert stats["num_pause_preemptions"] == 0 and stats["num_recomputed_tokens"] == 0
        else:
            assert 0 < stats["num_pause_preemptions"] <= 300 // 4  # type: ignore[operator]
