"""Request lifecycle (`contbatch.core.lifecycle` and `SchedulerBase`), stepped by hand.

- `ttft_timeout` / `request_timeout`: a request ends TIMEOUT at the first `schedule(now)` with
  now - arrival >= the limit (never before), its detail naming the limit, its KV freed, its
  partial output kept; `next_timer()` says when the next one fires.
- `max_waiting`: a full waiting queue rejects with kind "queue_full".
- `cancel`: at any moment (waiting, running, mid-prefill, while its step runs, preempted, swapped
  out) the request's device and host blocks are free right after the call, it ends CANCELLED
  once, its timeline keeps the tokens it got, and tokens of its step in flight count as unsent.
- output credits: a running request with `output_credits` unsent tokens is paused (not
  scheduled) until the client acks enough to free half its credits; `ack` resumes it then and
  the pause is counted in `paused_time`; past `max_pause` it is preempted only for someone who
  waits.
"""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    RequestStatus,
    SchedulerBase,
    SchedulerConfig,
    check_invariants,
)
from contbatch.core.config import KVConfig, LifecycleConfig

from .drive import add, held_device_host, sampled, step


def config(**lifecycle: object) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=1,
        kv=KVConfig(block_size=2, num_blocks=64, watermark=0.0),
        lifecycle=LifecycleConfig(**lifecycle),  # type: ignore[arg-type]
    )


# -- timeouts -----------------------------------------------------------------------------------
def test_ttft_timeout_ends_a_waiting_request_at_the_limit_not_before() -> None:
    s = ContinuousScheduler(config(ttft_timeout=4.0))
    busy = add(s, "busy", 0.0, 2, 20)
    late = add(s, "late", 1.0, 2, 2)
    assert s.next_timer() == 4.0  # busy's ttft limit (it has no token yet)
    step(s, 0.0)  # busy gets its first token: only late's limit is left
    assert s.next_timer() == 5.0
    for t in (1.0, 2.0, 3.0, 4.0):
        step(s, t)
        assert late.status is RequestStatus.WAITING
    step(s, 4.5)
    assert late.status is RequestStatus.WAITING  # 3.5 < 4
    step(s, 5.0)
    assert late.finish_reason is FinishReason.TIMEOUT and late.timeline.finished_ts == 5.0
    assert "ttft_timeout" in late.finish_detail and "4" in late.finish_detail
    assert not late.timeline.scheduled_ts and late.timeline.num_output_tokens == 0
    assert busy.status is RequestStatus.RUNNING and s.next_timer() is None
    assert s.stats.num_unsent_tokens == 0


def test_ttft_timeout_ends_a_running_request_mid_prefill_and_frees_its_kv() -> None:
    s = ContinuousScheduler(config(ttft_timeout=2.0))
    long = add(s, "long", 0.0, 30, 2)  # 4 steps of 8 prompt tokens before its first token
    step(s, 0.0)
    step(s, 1.0)
    assert long.status is RequestStatus.RUNNING and held_device_host(s, "long") == (8, 0)
    out = s.schedule(2.0)
    assert long.finish_reason is FinishReason.TIMEOUT and "ttft_timeout" in long.finish_detail
    assert held_device_host(s, "long") == (0, 0) and s.memory is not None and s.memory.kv.num_used_blocks == 0
    assert out.is_empty and out.finished_ids == ("long",)
    assert long.timeline.scheduled_ts == [0.0] and long.timeline.finished_ts == 2.0


def test_ttft_timeout_spares_a_request_that_has_its_first_token() -> None:
    s = ContinuousScheduler(config(ttft_timeout=1.5))
    r = add(s, "r", 0.0, 2, 4)
    for t in range(4):
        step(s, float(t))
    assert r.finish_reason is FinishReason.LENGTH and r.timeline.finished_ts == 4.0


def test_request_timeout_ends_a_running_request_keeping_its_partial_output() -> None:
    s = ContinuousScheduler(config(request_timeout=3.0))
    r = add(s, "r", 0.0, 3, 10)
    for t in (0.0, 1.0, 2.0):
        step(s, t)
    assert r.num_output_tokens == 3 and held_device_host(s, "r") == (3, 0)
    assert s.next_timer() == 3.0
    s.ack("r", 3, 3.0)  # the client took everything: nothing is wasted
    out = s.schedule(3.0)
    assert r.finish_reason is FinishReason.TIMEOUT and "request_timeout" in r.finish_detail
    assert r.timeline.finished_ts == 3.0 and r.timeline.token_ts == [1.0, 2.0, 3.0]
    assert held_device_host(s, "r") == (0, 0) and out.is_empty and s.stats.num_unsent_tokens == 0


def test_request_timeout_counts_unread_tokens_as_unsent() -> None:
    s = ContinuousScheduler(config(request_timeout=2.5))
    r = add(s, "r", 0.0, 3, 10)
    step(s, 0.0)
    step(s, 1.0)
    s.ack("r", 1, 2.0)
    step(s, 2.0)
    s.schedule(3.0)
    assert r.finish_reason is FinishReason.TIMEOUT and r.num_output_tokens == 3
    assert s.stats.num_unsent_tokens == 2


def test_request_timeout_wins_over_ttft_and_both_fire_at_or_after_the_limit() -> None:
    s = ContinuousScheduler(config(ttft_timeout=2.0, request_timeout=2.0))
    add(s, "busy", 0.0, 2, 20)
    w = add(s, "w", 0.0, 2, 2)
    step(s, 0.0)
    step(s, 1.0)
    s.schedule(2.0)
    assert w.finish_reason is FinishReason.TIMEOUT and "request_timeout" in w.finish_detail
    assert w.timeline.finished_ts is not None and w.timeline.finished_ts - w.arrival_ts >= 2.0


def test_expire_timeouts_at_the_next_timer_ends_exactly_the_due_requests() -> None:
    s = ContinuousScheduler(config(ttft_timeout=3.0))
    a = add(s, "a", 0.0, 2, 2)
    b = add(s, "b", 1.0, 2, 2)
    t = s.next_timer()
    assert t == 3.0
    s.expire_timeouts(t)
    assert a.finish_reason is FinishReason.TIMEOUT and b.status is RequestStatus.WAITING
    assert s.next_timer() == 4.0


def test_a_timeout_fires_at_the_time_next_timer_reports() -> None:
    # in floats (0.3 + 0.4) - 0.3 = 0.39999999999999997 < 0.4: a `now - arrival >= limit` test would
    # miss the timer next_timer reports (and an idle simulator would stall there)
    s = ContinuousScheduler(config(ttft_timeout=0.4))
    add(s, "busy", 0.0, 2, 20)
    late = add(s, "late", 0.3, 2, 2)
    step(s, 0.0)  # busy has its first token: only late's limit is left
    t = s.next_timer()
    assert t == 0.3 + 0.4
    s.schedule(t)
    assert late.finish_reason is FinishReason.TIMEOUT and late.timeline.finished_ts == t


@pytest.mark.parametrize(("arrival", "limit"), [(0.1, 4.0), (0.2, 0.5), (0.3, 0.6), (51.867215500000015, 0.05)])
def test_every_timer_fires_exactly_at_next_timer(arrival: float, limit: float) -> None:
    for knob in ("ttft_timeout", "request_timeout"):
        s = ContinuousScheduler(config(**{knob: limit}))
        r = add(s, "r", arrival, 2, 2)
        t = s.next_timer()
        assert t == arrival + limit
        s.schedule(t)
        assert r.finish_reason is FinishReason.TIMEOUT and knob in r.finish_detail


# -- the waiting-queue bound --------------------------------------------------------------------
def test_max_waiting_rejects_with_queue_full_beyond_the_free_seats() -> None:
    s = ContinuousScheduler(config(max_waiting=2))  # one seat (max_num_seqs=1), free at first
    a = add(s, "a", 0.0, 2, 3)  # takes the free seat at the next step: not counted as waiting
    b = add(s, "b", 0.0, 2, 3)
    c = add(s, "c", 0.0, 2, 3)
    d = add(s, "d", 0.0, 2, 3)
    assert a.status is b.status is c.status is RequestStatus.WAITING
    assert d.finish_reason is FinishReason.REJECTED and d.timeline.finished_ts == 0.0
    assert "queue is full" in d.finish_detail and "2" in d.finish_detail
    assert s.stats.rejections == {"queue_full": 1}
    step(s, 0.0)  # a runs: b and c wait, the seat is taken
    e = add(s, "e", 1.0, 2, 3)
    assert e.finish_reason is FinishReason.REJECTED
    assert s.stats.rejections == {"queue_full": 2}
    assert s.stats.num_unsent_tokens == 0


# -- cancel at any moment ------------------------------------------------------------------------
def check_cancelled(s: SchedulerBase, r: Request, now: float, num_tokens: int) -> None:
    assert s.cancel(r.request_id, now)
    assert held_device_host(s, r.request_id) == (0, 0) and r.kv_capacity == 0
    assert r.finish_reason is FinishReason.CANCELLED and r.timeline.finished_ts == now
    assert r.timeline.num_output_tokens == num_tokens == r.num_output_tokens
    assert r not in s.running and r not in list(s.waiting) and r.request_id not in s.requests
    check_invariants(s)
    assert not s.cancel(r.request_id, now)  # once


def test_cancel_waiting_running_and_mid_prefill_frees_blocks_at_once() -> None:
    s = ContinuousScheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, kv=KVConfig(block_size=2, num_blocks=64))
    )
    dec = add(s, "dec", 0.0, 2, 9)
    pre = add(s, "pre", 0.0, 20, 2)
    wait = add(s, "wait", 0.0, 2, 2)
    step(s, 0.0)
    step(s, 1.0)
    assert dec.num_output_tokens == 2 and held_device_host(s, "dec")[0] == 2
    assert pre.status is RequestStatus.RUNNING and 0 < pre.num_computed_tokens < 20
    assert wait.status is RequestStatus.WAITING  # the budget went to dec and pre's chunks
    check_cancelled(s, pre, 2.5, 0)
    check_cancelled(s, dec, 2.5, 2)
    assert dec.timeline.token_ts == [1.0, 2.0]
    check_cancelled(s, wait, 2.75, 0)
    assert not s.has_unfinished() and s.memory is not None and s.memory.kv.num_used_blocks == 0


def test_cancel_while_its_step_runs_frees_blocks_and_drops_the_steps_tokens() -> None:
    s = ContinuousScheduler(config())
    r = add(s, "r", 0.0, 2, 9)
    step(s, 0.0)
    out = s.schedule(1.0)
    assert [c.request_id for c in out.chunks] == ["r"] and held_device_host(s, "r")[0] == 2
    s.ack("r", 1, 1.0)
    check_cancelled(s, r, 1.5, 1)
    s.update(out, sampled(out), 2.0)
    check_invariants(s)
    assert r.num_output_tokens == 1 and r.timeline.finished_ts == 1.5
    assert s.stats.num_unsent_tokens == 1  # the token of the step in flight reached nobody


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_cancel_a_preempted_request_frees_its_device_and_host_blocks(preemption: str) -> None:
    kv = KVConfig(block_size=1, num_blocks=6, num_host_blocks=8, watermark=0.0, preemption=preemption)
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=16, kv=kv))
    a = add(s, "a", 0.0, 3, 3)
    b = add(s, "b", 0.0, 3, 3)
    step(s, 0.0)  # 6 blocks used
    out = step(s, 1.0)  # a grows: b (newest) is preempted
    assert out.preempted_ids == ("b",) and b.status is RequestStatus.PREEMPTED
    assert held_device_host(s, "b") == ((0, 3) if preemption == "swap" else (0, 0))
    check_cancelled(s, b, 1.5, 1)
    assert s.memory is not None and s.memory.kv.num_free_host_blocks == s.memory.kv.num_host_blocks
    while s.has_unfinished():
        step(s, 2.0)
    assert a.finish_reason is FinishReason.LENGTH and s.memory.kv.num_used_blocks == 0


# -- output credits ------------------------------------------------------------------------------
def test_credits_pause_a_request_until_its_client_reads() -> None:
    s = ContinuousScheduler(config(output_credits=2))
    r = add(s, "r", 0.0, 2, 6)
    step(s, 0.0)
    step(s, 1.0)
    assert r.num_unsent_tokens == 2
    out = step(s, 2.0)
    assert out.is_empty and r.paused_since == 2.0 and r.num_output_tokens == 2
    step(s, 3.0)
    s.ack("r", 1, 4.5)
    assert r.paused_since is None and s.stats.paused_time == 2.5 and r.paused_time == 2.5
    out = step(s, 4.5)
    assert [c.request_id for c in out.chunks] == ["r"] and r.num_unsent_tokens == 2
    s.ack("r", 100, 6.0)  # more than generated: clamped
    assert r.num_sent_tokens == r.num_output_tokens == 3


def test_max_pause_cancel_ends_a_paused_request_with_timeout() -> None:
    s = ContinuousScheduler(config(output_credits=1, max_pause=2.0, pause_action="cancel"))
    r = add(s, "r", 0.0, 2, 6)
    step(s, 0.0)
    step(s, 1.0)  # paused at 1.0: one unsent token, no credit left
    assert r.paused_since == 1.0 and s.next_timer() == 3.0
    step(s, 2.0)
    s.schedule(3.0)
    assert r.finish_reason is FinishReason.TIMEOUT and "max_pause" in r.finish_detail
    assert s.stats.num_unsent_tokens == 1 and s.stats.paused_time == 2.0 and held_device_host(s, "r") == (0, 0)


def test_max_pause_preempt_frees_the_kv_for_a_waiting_request_and_readmits_after_a_read() -> None:
    s = ContinuousScheduler(config(output_credits=1, max_pause=2.0, pause_action="preempt"))
    r = add(s, "r", 0.0, 2, 3)
    step(s, 0.0)
    step(s, 1.0)  # paused at 1.0
    w = add(s, "w", 2.5, 2, 1)  # waits for the only seat
    assert s.next_timer() == 3.0  # now that someone waits, the pause limit can fire
    out = step(s, 3.0)
    assert out.preempted_ids == ("r",) and r.status is RequestStatus.PREEMPTED
    assert [c.request_id for c in out.chunks] == ["w"]  # the seat went to the waiting request
    assert s.stats.num_pause_preemptions == 1 and held_device_host(s, "r") == (0, 0)
    out = step(s, 4.0)  # no credit: skipped in the queue
    assert out.is_empty and r.status is RequestStatus.PREEMPTED and w.finish_reason is FinishReason.LENGTH
    s.ack("w", 1, 5.0)
    now = 5.0
    while s.has_unfinished():
        s.ack("r", 1, now)
        step(s, now)
        now += 1.0
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3


def test_a_paused_request_keeps_its_seat_and_kv_while_nobody_waits() -> None:
    """No thrash: pausing past max_pause preempts only for someone who waits; alone, the request
    keeps its KV (no recompute) and goes on when its client reads."""
    s = ContinuousScheduler(config(output_credits=1, max_pause=2.0, pause_action="preempt"))
    r = add(s, "r", 0.0, 2, 3)
    step(s, 0.0)
    step(s, 1.0)  # paused at 1.0
    assert s.next_timer() is None  # the pause limit cannot fire with nobody waiting
    out = step(s, 10.0)
    assert out.is_empty and not out.preempted_ids and r.status is RequestStatus.RUNNING
    assert held_device_host(s, "r")[0] > 0 and s.stats.num_pause_preemptions == 0
    now = 11.0
    while s.has_unfinished():
        s.ack("r", 1, now)
        step(s, now)
        now += 1.0
    assert r.finish_reason is FinishReason.LENGTH and s.stats.num_recomputed_tokens == 0


def test_a_client_that_fell_behind_resumes_only_with_half_its_credits_free() -> None:
    """Hysteresis: with 4 credits a paused request resumes when 2 are free, not at the first read."""
    s = ContinuousScheduler(config(output_credits=4))
    r = add(s, "r", 0.0, 2, 10)
    for t in range(5):
        step(s, float(t))
    assert r.num_output_tokens == 4 and r.paused_since is not None
    s.ack("r", 1, 5.0)  # one credit free: still paused, not scheduled
    assert r.paused_since is not None and step(s, 5.0).is_empty
    s.ack("r", 1, 6.0)  # two free: it resumes
    assert r.paused_since is None and s.stats.paused_time == 2.0
    assert [c.request_id for c in step(s, 6.0).chunks] == ["r"]


def test_a_pause_preemption_by_swap_keeps_a_reserved_request_whole() -> None:
    kv = KVConfig(block_size=1, num_blocks=8, num_host_blocks=8, watermark=0.0, admission="reserve", preemption="swap")
    s = ContinuousScheduler(
        SchedulerConfig(
            max_num_batched_tokens=8,
            kv=kv,
            lifecycle=LifecycleConfig(output_credits=1, max_pause=1.0, pause_action="preempt"),
        )
    )
    r = add(s, "r", 0.0, 2, 3)
    step(s, 0.0)
    assert held_device_host(s, "r") == (5, 0)  # the whole reservation: 2 prompt + 3 output tokens
    step(s, 1.0)  # paused: its client has not read its token
    add(s, "w", 1.5, 6, 2)  # 8 blocks reserved: it waits for r's memory
    out = step(s, 2.0)
    assert out.preempted_ids == ("r",) and s.stats.num_pause_preemptions == 1
    assert held_device_host(s, "r")[0] == 0 and r.status is RequestStatus.PREEMPTED
    s.ack("r", 1, 3.0)
    now = 3.0
    while s.has_unfinished():  # check_invariants after every step: a running reserved request holds 5
        s.ack("w", 1, now)
        s.ack("r", 1, now)
        step(s, now)
        now += 1.0
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3
