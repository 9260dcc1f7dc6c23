"""Property tests of whole simulated runs: random traces (float arrivals too), random configs,
both schedulers, `check_invariants` after every step.

At the end: every request has exactly one finish reason; rejected ones (and only the ones the
configuration can never run) carry a `finish_detail`; the others produced exactly their output
length, so output tokens are conserved; each timeline's timestamps are monotonic; and the run is
deterministic (the same trace twice gives equal timelines).
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from contbatch.core import (
    ContinuousScheduler,
    EventKind,
    FinishReason,
    Request,
    SchedulerBase,
    SchedulerConfig,
    SchedulerOutput,
    StaticScheduler,
    check_invariants,
)
from contbatch.core.timeline import Timeline
from contbatch.sim.cost import AffineCost, CostModel, UnitCost
from contbatch.sim.loop import SimResult, simulate
from contbatch.traces import Trace, TraceRequest

from .recording import recording

configs = st.builds(
    SchedulerConfig,
    max_num_batched_tokens=st.integers(1, 64),
    max_num_seqs=st.none() | st.integers(1, 8),
    sample_on_prefill=st.booleans(),
    chunked_prefill=st.booleans(),
    skip_blocked=st.booleans(),
    max_model_len=st.none() | st.integers(2, 48),
)
arrivals = st.integers(0, 20).map(float) | st.floats(0.0, 20.0, allow_nan=False, allow_infinity=False)
trace_requests = st.lists(st.tuples(arrivals, st.integers(1, 80), st.integers(1, 10)), min_size=1, max_size=12).map(
    lambda rows: Trace(
        "gen", tuple(TraceRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(rows)), "tick", "hypothesis"
    )
)
costs = st.integers(1, 16).map(UnitCost) | st.just(AffineCost())


def make(static: bool, config: SchedulerConfig) -> SchedulerBase:
    """A scheduler that records the requests handed over (`recording`)."""
    return recording(StaticScheduler if static else ContinuousScheduler)(config)  # type: ignore[no-any-return]


def run(trace: Trace, scheduler: SchedulerBase, cost: CostModel) -> tuple[SimResult, list[Request]]:
    """simulate, checking invariants after each step; also the Request objects (`make`'s record)."""
    added: list[Request] = scheduler.handed_over  # type: ignore[attr-defined]
    last_now = [float("-inf")]

    def on_step(s: SchedulerBase, out: SchedulerOutput, now: float) -> None:
        check_invariants(s)
        assert not out.is_empty
        assert now > last_now[0]  # every step takes time
        last_now[0] = now
        if s.config.max_num_seqs is not None:
            assert out.num_requests <= s.config.max_num_seqs

    return simulate(trace, scheduler, cost, inspect=on_step), added


def expected_rejection(static: bool, config: SchedulerConfig, spec: TraceRequest) -> bool:
    total = spec.num_prompt_tokens + spec.num_output_tokens
    if config.max_model_len is not None and total > config.max_model_len:
        return True
    return not static and not config.chunked_prefill and spec.num_prompt_tokens > config.max_num_batched_tokens


def check_monotonic(tl: Timeline) -> None:
    ts = [e.ts for e in tl.events()]
    assert ts == sorted(ts)
    assert tl.scheduled_ts == sorted(tl.scheduled_ts)
    assert all(a < b for a, b in zip(tl.token_ts, tl.token_ts[1:], strict=False))
    assert tl.finished_ts is not None and tl.finished_ts >= tl.arrival_ts
    if tl.scheduled_ts:
        assert tl.arrival_ts <= tl.scheduled_ts[0]
    if tl.token_ts:
        assert tl.scheduled_ts[0] < tl.token_ts[0] and tl.token_ts[-1] <= tl.finished_ts


def snapshot(result: SimResult) -> list[tuple[object, ...]]:
    return [
        (tl.request_id, tl.arrival_ts, tuple(tl.scheduled_ts), tuple(tl.preempted_ts), tuple(tl.token_ts),
         tuple(tl.token_counts), tl.finished_ts, tl.finish_reason)
        for tl in result.timelines
    ]  # fmt: skip


@settings(
    max_examples=3 * settings().max_examples,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(trace=trace_requests, config=configs, static=st.booleans(), cost=costs)
def test_simulated_runs_keep_every_invariant(
    trace: Trace, config: SchedulerConfig, static: bool, cost: CostModel
) -> None:
    result, requests = run(trace, make(static, config), cost)
    assert [r.request_id for r in requests] == [t.request_id for t in trace.requests]
    assert [tl.request_id for tl in result.timelines] == [t.request_id for t in trace.requests]
    produced = wanted = 0
    for spec, request, tl in zip(trace.requests, requests, result.timelines, strict=True):
        assert request.timeline is tl
        finished = [e for e in tl.events() if e.kind is EventKind.FINISHED]
        assert len(finished) == 1 and finished[0].reason is tl.finish_reason is request.finish_reason
        check_monotonic(tl)
        if expected_rejection(static, config, spec):
            event("a request is rejected")
            assert tl.finish_reason is FinishReason.REJECTED
            assert request.finish_detail
            assert not tl.scheduled_ts and tl.num_output_tokens == 0
        else:
            assert tl.finish_reason is FinishReason.LENGTH
            assert tl.num_output_tokens == spec.num_output_tokens
            assert tl.finished_ts == tl.token_ts[-1]
            wanted += spec.num_output_tokens
        produced += tl.num_output_tokens
    assert produced == wanted  # output tokens conserved
    first_arrival = trace.requests[0].arrival_ts
    makespan = max(tl.finished_ts for tl in result.timelines if tl.finished_ts is not None) - first_arrival
    assert result.busy_time <= makespan + 1e-9  # steps never overlap
    if static:
        assert result.padding_tokens >= 0
    else:
        assert result.padding_tokens == 0
    again, _ = run(trace, make(static, config), cost)
    assert snapshot(again) == snapshot(result)
    assert (again.num_steps, again.padding_tokens, again.busy_time) == (
        result.num_steps,
        result.padding_tokens,
        result.busy_time,
    )
