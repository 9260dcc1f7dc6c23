"""Skip-ahead (`simulate(..., skip_ahead=True)`, the default) gives exactly the per-request
results of stepping through every step: same token timestamps, finish times and reasons, same
step count, busy time, KV usage and counters."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.core import ContinuousScheduler, SchedulerConfig, check_invariants
from contbatch.core.config import KVConfig
from contbatch.sim import AffineCost, SimResult, UnitCost, simulate
from contbatch.traces import Trace, TraceRequest


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(1, 14))
    requests = []
    for i in range(n):
        prompt = draw(st.integers(1, 40))
        output = draw(st.integers(1, 40))
        extra = draw(st.sampled_from([0, 0, 5]))
        requests.append(
            TraceRequest(
                f"r{i}",
                float(draw(st.integers(0, 60))) + draw(st.sampled_from([0.0, 0.25, 0.5])),
                prompt,
                output,
                max_output_tokens=output + extra,
                tenant=draw(st.sampled_from(["a", "b", None])),
            )
        )
    return Trace("gen", tuple(requests), "s", "hypothesis")


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    kv = draw(
        st.one_of(
            st.none(),
            st.builds(
                KVConfig,
                block_size=st.sampled_from([1, 4, 16]),
                num_blocks=st.integers(30, 200),
                admission=st.sampled_from(["reserve", "optimistic", "estimate"]),
                preemption=st.sampled_from(["recompute", "swap"]),
                num_host_blocks=st.sampled_from([0, 50]),
                watermark=st.sampled_from([0.0, 0.01]),
            ),
        )
    )
    return SchedulerConfig(
        max_num_batched_tokens=draw(st.sampled_from([16, 64, 512])),
        max_num_seqs=draw(st.sampled_from([None, 3, 8])),
        batch_buckets=draw(st.sampled_from([(), (1, 2, 4, 8)])),
        queue_order=draw(st.sampled_from(["fcfs", "fair"])),
        kv=kv,
    )


def _fits(trace: Trace, config: SchedulerConfig) -> Trace:
    """Keep requests that can ever run (rejections are tested elsewhere), so spans do happen."""
    if config.kv is None:
        return trace
    capacity = config.kv.num_blocks * config.kv.block_size
    kept = tuple(r for r in trace.requests if r.num_prompt_tokens + r.output_limit <= capacity)
    return dataclasses.replace(trace, requests=kept or trace.requests[:0])


def _fingerprint(result: SimResult) -> tuple[object, ...]:
    timelines = tuple(
        (t.request_id, tuple(t.scheduled_ts), tuple(t.preempted_ts), tuple(t.token_ts), t.finished_ts, t.finish_reason)
        for t in result.timelines
    )
    stats = dict(result.scheduler_stats)
    return timelines, result.num_steps, result.padding_tokens, stats


@settings(max_examples=300, deadline=None, derandomize=True)
@given(trace=traces(), config=configs(), unit=st.booleans())
def test_skip_ahead_equals_step_by_step(trace: Trace, config: SchedulerConfig, unit: bool) -> None:
    trace = _fits(trace, config)
    if not trace.requests:
        return
    cost = UnitCost(8) if unit else AffineCost()

    def check(scheduler: object, out: object, now: float) -> None:
        check_invariants(scheduler)  # type: ignore[arg-type]

    stepped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=False)
    skipped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=True, on_step=check)
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert abs(skipped.busy_time - stepped.busy_time) <= 1e-9 * max(1.0, stepped.busy_time)
    assert abs(skipped.kv_usage_mean - stepped.kv_usage_mean) <= 1e-9


def test_skip_ahead_really_skips() -> None:
    """On a decode-heavy trace most steps are taken in spans (checked through on_step calls)."""
    trace = Trace("long", tuple(TraceRequest(f"r{i}", 0.0, 32, 400) for i in range(8)), "s", "test")
    calls: list[float] = []
    result = simulate(
        trace,
        ContinuousScheduler(SchedulerConfig(kv=KVConfig())),
        AffineCost(),
        on_step=lambda s, o, n: calls.append(n),
    )
    assert result.num_steps >= 400
    assert len(calls) < result.num_steps / 10
