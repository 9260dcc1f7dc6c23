"""The simulator loop: arrivals at step boundaries, clock jumps, on_step, stall detection."""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    SchedulerBase,
    SchedulerConfig,
    SchedulerOutput,
    StaticScheduler,
    build_output,
    seed_config,
)
from contbatch.sim.cost import AffineCost, UnitCost
from contbatch.sim.loop import SimulationStalled, execute, simulate
from contbatch.traces import Trace, TraceRequest


def trace(*rows: tuple[float, int, int]) -> Trace:
    return Trace("t", tuple(TraceRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(rows)), "tick", "test")


def test_empty_trace() -> None:
    result = simulate(trace(), ContinuousScheduler(seed_config()), UnitCost(8))
    assert result.timelines == () and result.num_steps == 0 and result.busy_time == 0.0


def test_clock_jumps_to_the_next_arrival() -> None:
    result = simulate(trace((0, 2, 1), (10.5, 2, 1)), ContinuousScheduler(seed_config()), UnitCost(8))
    first, second = result.timelines
    assert first.token_ts == [2.0] and first.finished_ts == 2.0
    assert second.scheduled_ts == [10.5] and second.token_ts == [12.5]
    assert result.num_steps == 4 and result.busy_time == 4.0


def test_the_clock_starts_at_the_first_arrival() -> None:
    result = simulate(trace((5, 2, 1)), ContinuousScheduler(seed_config()), UnitCost(8))
    assert result.timelines[0].scheduled_ts == [5.0] and result.timelines[0].finished_ts == 7.0


def test_arrival_during_a_step_is_handed_over_at_its_end() -> None:
    # r0's prefill costs 2 ticks (16 tokens at 8 per tick): r1 arrives at 0.5, joins at t=2
    result = simulate(trace((0, 16, 1), (0.5, 1, 1)), ContinuousScheduler(SchedulerConfig()), UnitCost(8))
    late = result.timelines[1]
    assert late.arrival_ts == 0.5 and late.scheduled_ts == [2.0]


def test_inspect_runs_after_every_stepped_update_and_after_each_decode_run() -> None:
    for skip_ahead, expected in ((False, [(0, 1.0, 0), (1, 2.0, 0), (2, 3.0, 1)]), (True, [(0, 1.0, 0), (2, 3.0, 1)])):
        seen: list[tuple[int, float, int]] = []

        def hook(s: SchedulerBase, out: SchedulerOutput, now: float) -> None:
            seen.append((out.step_id, now, s.num_finished))  # noqa: B023 - called inside this iteration

        result = simulate(
            trace((0, 2, 2)), ContinuousScheduler(seed_config()), UnitCost(8), inspect=hook, skip_ahead=skip_ahead
        )
        assert seen == expected  # with skip-ahead, steps 1-2 are a decode run: inspected once, at its end
        assert result.num_steps == 3


def test_affine_cost_runs_in_seconds() -> None:
    result = simulate(trace((0, 512, 2)), ContinuousScheduler(SchedulerConfig()), AffineCost())
    assert result.time_unit == "s"
    tl = result.timelines[0]
    assert tl.token_ts[0] == pytest.approx(AffineCost().step_time(build_output(0, [])) + 512 * 0.000056 + 0.000128)
    assert tl.finish_reason is FinishReason.LENGTH


def test_rejected_requests_finish_at_their_hand_over() -> None:
    result = simulate(trace((0, 9, 1), (0, 2, 1)), ContinuousScheduler(seed_config()), UnitCost(8))
    rejected, ok = result.timelines
    assert rejected.finish_reason is FinishReason.REJECTED and rejected.finished_ts == 0.0
    assert ok.finish_reason is FinishReason.LENGTH


def test_static_counts_padding() -> None:
    result = simulate(trace((0, 4, 5), (0, 2, 2)), StaticScheduler(seed_config()), UnitCost(8))
    assert result.padding_tokens == 2 + 3
    assert result.scheduler == "static"


def test_execute_samples_one_dummy_token_per_sampling_chunk() -> None:
    s = ContinuousScheduler(seed_config())
    s.add_request(Request("a", 0.0, 2, 1), 0.0)
    s.add_request(Request("b", 0.0, 2, 1), 0.0)
    prefill = s.schedule(0.0)
    assert dict(execute(prefill).sampled_token_ids) == {}  # the seed's prefill samples nothing
    s.update(prefill, execute(prefill), 1.0)
    assert set(execute(s.schedule(1.0)).sampled_token_ids) == {"a", "b"}


class _Idle(SchedulerBase):
    """A scheduler that accepts requests and never schedules any."""

    def schedule(self, now: float) -> SchedulerOutput:
        return build_output(self._next_step_id(), [])


def test_a_scheduler_that_never_schedules_stalls_loudly() -> None:
    with pytest.raises(SimulationStalled):
        simulate(trace((0, 2, 1), (3, 2, 1)), _Idle(seed_config()), UnitCost(8))
