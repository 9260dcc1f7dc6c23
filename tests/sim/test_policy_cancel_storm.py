"""The built-in `cancel-storm` trace (half the clients cancel 0.5-8 s after arriving), simulated with
the `engine` preset and the `affine` cost.

- every cancellation frees the request's device and host blocks in the call that cancels it, so
  in the step it happens; after every step the pool holds exactly the running requests' blocks;
- nothing leaks: at the end no block is used;
- a cancelled request ends CANCELLED at its own cancel time and keeps the tokens it got;
- the other requests' outputs (finish reason, output tokens) are exactly those of a run of the same
  trace without the cancelled requests.

Each check runs stepping through every step (`skip_ahead=False`, where `simulate` has the option)
and with the simulator's default (skip-ahead over spans of pure decoding, which must stop before a
step during which a client cancels: a regression test below pins the minimal case).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    SchedulerBase,
    SchedulerConfig,
    SchedulerOutput,
    check_invariants,
)
from contbatch.core import preset_config as preset
from contbatch.core.status import RequestStatus
from contbatch.sim import AffineCost, SimResult, UnitCost, simulate
from contbatch.traces import Trace, TraceRequest
from contbatch.traces.scenarios import cancel_storm

from .recording import recording

HAS_SKIP_AHEAD = "skip_ahead" in inspect.signature(simulate).parameters
MODES = ["stepwise", "default"]


def sim_options(mode: str) -> dict[str, bool]:
    return {"skip_ahead": False} if mode == "stepwise" and HAS_SKIP_AHEAD else {}


class CancelWatch:
    """Runs around `scheduler.cancel` to check the blocks right after each call, and checks the pool
    after every step (the full invariants every 25 steps: a 6,144-block pool costs per check)."""

    def __init__(self, scheduler: SchedulerBase) -> None:
        assert scheduler.memory is not None
        self.kv = scheduler.memory.kv
        self.cancelled: dict[str, float] = {}  # id -> time of the cancel call
        self.num_in_step: list[int] = []
        self._step_cancels = 0

        def watched(request_id: str, now: float, call: Callable[[], bool]) -> bool:
            running = (
                request_id in scheduler.requests and scheduler.requests[request_id].status is RequestStatus.RUNNING
            )
            held_before = self.kv.num_held_blocks(request_id)
            done = call()
            if done:
                assert self.kv.num_held_blocks(request_id) == 0 and self.kv.num_held_host_blocks(request_id) == 0
                assert request_id not in scheduler.requests
                assert not running or held_before > 0  # a running request did hold blocks before
                self.cancelled[request_id] = now
                self._step_cancels += 1
            return done

        scheduler.around_cancel = watched  # type: ignore[attr-defined]  (a `recording` scheduler)

    def __call__(self, s: SchedulerBase, out: SchedulerOutput, now: float) -> None:
        held = sum(self.kv.num_held_blocks(r.request_id) for r in s.running)
        assert self.kv.num_used_blocks == held  # cancelled (and finished) requests hold nothing
        assert all(self.kv.num_held_blocks(rid) == 0 for rid in self.cancelled)
        self.num_in_step.append(self._step_cancels)
        self._step_cancels = 0
        if out.step_id % 25 == 0:
            check_invariants(s)


@functools.cache
def storm(mode: str) -> tuple[SimResult, CancelWatch, int]:
    scheduler = recording(ContinuousScheduler)(preset("engine"))
    watch = CancelWatch(scheduler)
    result = simulate(cancel_storm(), scheduler, AffineCost(), inspect=watch, **sim_options(mode))
    assert scheduler.memory is not None
    return result, watch, scheduler.memory.kv.num_used_blocks


@pytest.mark.parametrize("mode", MODES)
def test_cancellations_free_their_blocks_at_once_and_nothing_leaks(mode: str) -> None:
    result, watch, used_at_end = storm(mode)
    assert used_at_end == 0
    reasons = {t.request_id: t.finish_reason for t in result.timelines}
    cancelled = {rid for rid, reason in reasons.items() if reason is FinishReason.CANCELLED}
    assert cancelled == set(watch.cancelled)
    assert 50 < len(cancelled) <= 150  # half the clients cancel; some finish before they do
    assert sum(1 for n in watch.num_in_step if n) > 50  # cancellations spread over many steps
    # running ones were among them: some cancelled requests had tokens
    assert any(t.num_output_tokens for t in result.timelines if t.request_id in cancelled)


@pytest.mark.parametrize("mode", MODES)
def test_a_cancelled_request_ends_at_its_cancel_time_with_its_partial_output(mode: str) -> None:
    result, watch, _ = storm(mode)
    specs = {r.request_id: r for r in cancel_storm().requests}
    for t in result.timelines:
        spec = specs[t.request_id]
        if t.finish_reason is FinishReason.CANCELLED:
            assert spec.cancel_ts is not None and t.finished_ts == spec.cancel_ts == watch.cancelled[t.request_id]
            assert t.num_output_tokens < spec.num_output_tokens
            assert all(ts <= spec.cancel_ts for ts in t.token_ts)
        else:
            assert t.finish_reason is FinishReason.LENGTH and t.num_output_tokens == spec.num_output_tokens
            assert spec.cancel_ts is None or (t.finished_ts is not None and t.finished_ts <= spec.cancel_ts)
    stats = result.run_stats()
    assert stats["generated_tokens"] == sum(t.num_output_tokens for t in result.timelines)
    assert stats["sent_tokens"] == stats["generated_tokens"] - stats["num_unsent_tokens"]  # type: ignore[operator]


@pytest.mark.parametrize("mode", MODES)
def test_the_others_get_exactly_what_they_get_without_the_cancelled_requests(mode: str) -> None:
    result, _, _ = storm(mode)
    cancelled = {t.request_id for t in result.timelines if t.finish_reason is FinishReason.CANCELLED}
    trace = cancel_storm()
    kept = Trace("cancel-storm-kept", tuple(r for r in trace.requests if r.request_id not in cancelled), "s", "test")
    without = simulate(kept, ContinuousScheduler(preset("engine")), AffineCost(), **sim_options(mode))

    def outputs(r: SimResult) -> dict[str, tuple[FinishReason | None, int]]:
        return {
            t.request_id: (t.finish_reason, t.num_output_tokens) for t in r.timelines if t.request_id not in cancelled
        }

    assert outputs(result) == outputs(without)
    assert len(outputs(without)) == len(trace.requests) - len(cancelled)


def test_the_storm_with_cancel_times_stripped_is_the_baseline() -> None:
    # sanity of the comparison: the storm's cancellations are what makes the runs differ
    plain = Trace("plain", tuple(dataclasses.replace(r, cancel_ts=None) for r in cancel_storm().requests), "s", "test")
    result = simulate(plain, ContinuousScheduler(preset("engine")), AffineCost())
    assert all(t.finish_reason is FinishReason.LENGTH for t in result.timelines)
    assert result.run_stats()["num_unsent_tokens"] == 0


@pytest.mark.skipif(not HAS_SKIP_AHEAD, reason="simulate has no skip-ahead")
def test_a_cancel_inside_a_skipped_ahead_span_is_applied_like_a_mid_step_cancel() -> None:
    # one request, unit cost: tokens at 1 and 2 (and 3); the client cancels at 1.25, inside the
    # second step. Stepping: CANCELLED at 1.25 with one token (the second step's token is dropped).
    trace = Trace("t", (TraceRequest("r0", 0.0, 1, 3, cancel_ts=1.25),), "tick", "hand-built")
    stepped = simulate(trace, ContinuousScheduler(SchedulerConfig()), UnitCost(), skip_ahead=False)
    assert stepped.timelines[0].token_ts == [1.0] and stepped.timelines[0].finished_ts == 1.25
    skipped = simulate(trace, ContinuousScheduler(SchedulerConfig()), UnitCost())
    tl = skipped.timelines[0]
    assert (tl.token_ts, tl.finished_ts, tl.finish_reason) == ([1.0], 1.25, FinishReason.CANCELLED)
