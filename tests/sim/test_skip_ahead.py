"""Skip-ahead (`simulate(..., skip_ahead=True)`, the default: decode runs that admit arrivals,
`contbatch.sim.decode_run`) gives exactly the per-request results of stepping through every
step: same token timestamps, finish times and reasons, same step count, busy time, KV usage and
counters, and the same per-step records for observers (step ids, times, batch sizes, tokens,
context, padding, KV usage), under every cost model and across the configuration knobs a run
must respect."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.core import PRESETS, ContinuousScheduler, SchedulerConfig, check_invariants, seed_config
from contbatch.core.config import KVConfig, LifecycleConfig, TenantConfig
from contbatch.loop import StepObserver, StepRecord
from contbatch.sim import AffineCost, SimResult, UnitCost, parse_cost, simulate
from contbatch.sim.cost import CostModel
from contbatch.traces import Trace, TraceRequest
from contbatch.traces.synthetic import fixed, generate, poisson, uniform

COSTS: dict[str, CostModel] = {
    "unit": UnitCost(8),
    "affine": AffineCost(),
    "roofline": parse_cost("roofline:llama-2-7b@a100"),
    "roofline-tp": parse_cost("roofline:llama-3-70b@h100x4"),
    "moe": parse_cost("roofline:mixtral-8x7b@h100x2"),
}


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(1, 14))
    clients = draw(st.booleans())  # without cancellations and read rates, runs admit arrivals
    requests = []
    for i in range(n):
        prompt = draw(st.integers(1, 40))
        output = draw(st.integers(1, 40))
        extra = draw(st.sampled_from([0, 0, 5]))
        arrival = float(draw(st.integers(0, 60))) + draw(st.sampled_from([0.0, 0.25, 0.5]))
        cancel_after = draw(st.sampled_from([None, None, None, None, 0.3, 2.0, 7.0])) if clients else None
        requests.append(
            TraceRequest(
                f"r{i}",
                arrival,
                prompt,
                output,
                max_output_tokens=output + extra,
                tenant=draw(st.sampled_from(["a", "b", None])),
                priority=draw(st.integers(0, 2)),
                cancel_ts=None if cancel_after is None else arrival + cancel_after,
                read_rate=draw(st.sampled_from([None, None, None, None, 0.5, 20.0])) if clients else None,
                **_shared_prefix(draw, prompt),
            )
        )
    return Trace("gen", tuple(requests), "s", "hypothesis")


def _shared_prefix(draw: st.DrawFn, prompt: int) -> dict[str, object]:
    """A prompt's share of a prefix group (its blocks hash alike across the group; with prefix
    caching on, later members of the group hit the cached blocks), or none."""
    group = draw(st.sampled_from([None, None, "g0", "g1"]))
    return {"prefix_group": group, "prefix_tokens": min(prompt, draw(st.sampled_from([4, 16, 32])))} if group else {}


def kv_configs(
    num_blocks: st.SearchStrategy[int], admission: list[str], watermark: list[float]
) -> st.SearchStrategy[KVConfig | None]:
    """No KV limit, or a paged pool of `num_blocks` blocks of 1, 4 or 16 tokens."""
    return st.one_of(
        st.none(),
        st.builds(
            KVConfig,
            block_size=st.sampled_from([1, 4, 16]),
            num_blocks=num_blocks,
            admission=st.sampled_from(admission),
            preemption=st.sampled_from(["recompute", "swap"]),
            num_host_blocks=st.sampled_from([0, 50]),
            watermark=st.sampled_from(watermark),
            # runs take preemptions themselves, by recompute or swap, whatever the victim rule
            victim=st.sampled_from(["newest", "newest", "lowest_priority", "fewest_generated"]),
            max_preemptions=st.sampled_from([None, None, 1]),
            enable_prefix_caching=st.booleans(),
        ),
    )


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    kv = draw(kv_configs(st.integers(30, 200), ["reserve", "optimistic", "estimate"], [0.0, 0.01]))
    sample_on_prefill = draw(st.sampled_from([True, True, False]))  # False: the seed's semantics
    return SchedulerConfig(
        max_num_batched_tokens=draw(st.sampled_from([16, 64, 512])),
        sample_on_prefill=sample_on_prefill,
        defer_partial_prefills=sample_on_prefill and draw(st.booleans()),
        max_num_seqs=draw(st.sampled_from([None, 3, 8])),
        chunked_prefill=draw(st.booleans()),
        max_prefill_tokens_per_request=draw(st.sampled_from([None, 8])),
        prefill_first=draw(st.booleans()),
        skip_blocked=draw(st.booleans()),
        batch_buckets=draw(st.sampled_from([(), (1, 2, 4, 8)])),
        queue_order=draw(st.sampled_from(["fcfs", "fair", "priority"])),
        priority_preemption=draw(st.sampled_from([None, 1])),
        tenants=draw(st.sampled_from([TenantConfig(), TenantConfig(max_running=2)])),
        lifecycle=draw(st.sampled_from([LifecycleConfig(), LifecycleConfig(max_waiting=3)])),
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
    return timelines, result.num_steps, result.padding_tokens, stats, result.unsent_tokens, result.max_buffered_tokens


class StepLog(StepObserver):
    """Every step record, as the fields a plot or a metrics exporter reads."""

    def __init__(self) -> None:
        self.rows: list[tuple[object, ...]] = []

    def on_step(self, record: StepRecord) -> None:
        out = record.out
        self.rows.append(
            (
                out.step_id,
                record.start_ts,
                record.end_ts,
                out.num_requests,
                out.num_prefill_tokens,
                out.num_decode_tokens,
                out.num_context_tokens,
                out.num_padding_tokens,
                record.kv_usage,
                record.num_sampled_tokens,
            )
        )


@settings(max_examples=3 * settings().max_examples, deadline=None, derandomize=True)
@given(trace=traces(), config=configs(), cost_name=st.sampled_from(sorted(COSTS)))
def test_skip_ahead_equals_step_by_step(trace: Trace, config: SchedulerConfig, cost_name: str) -> None:
    trace = _fits(trace, config)
    if not trace.requests:
        return
    cost = COSTS[cost_name]

    def check(scheduler: object, out: object, now: float) -> None:
        check_invariants(scheduler)  # type: ignore[arg-type]

    if cost_name == "moe":
        cost.reset_stats()  # type: ignore[attr-defined]
    stepped_log, skipped_log = StepLog(), StepLog()
    stepped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=False, observers=[stepped_log])
    skipped = simulate(trace, ContinuousScheduler(config), cost, inspect=check, observers=[skipped_log])
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped_log.rows == stepped_log.rows
    assert len(stepped_log.rows) == stepped.num_steps
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
        inspect=lambda s, o, n: calls.append(n),
    )
    assert result.num_steps >= 400
    assert len(calls) < result.num_steps / 10


def test_decode_runs_admit_arrivals() -> None:
    """Under steady Poisson load (the planning workload's shape) arrivals join runs instead of
    ending them: far fewer on_step calls than steps, and the same results as stepping."""
    trace = generate("steady", 300, poisson(4.0), uniform(50, 400), uniform(20, 120), seed=3)
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, kv=KVConfig(num_blocks=4000))
    cost = COSTS["roofline"]
    calls: list[float] = []
    stepped_log, skipped_log = StepLog(), StepLog()
    stepped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=False, observers=[stepped_log])
    skipped = simulate(
        trace, ContinuousScheduler(config), cost, inspect=lambda s, o, n: calls.append(n), observers=[skipped_log]
    )
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped.kv_usage_mean == stepped.kv_usage_mean
    assert skipped_log.rows == stepped_log.rows
    assert len(calls) < skipped.num_steps / 20


@pytest.mark.parametrize(
    ("kv_fields", "swap_outs"),
    [
        ({}, 0),  # by recompute, whatever the victim rule
        ({"victim": "lowest_priority"}, 0),
        ({"victim": "fewest_generated", "max_preemptions": 2}, 0),
        ({"preemption": "swap", "num_host_blocks": 60}, 136),  # every victim swapped out and back in
        ({"preemption": "swap", "num_host_blocks": 6}, 60),  # the host full at times: recompute then
        ({"preemption": "swap", "num_host_blocks": 12, "victim": "fewest_generated"}, 105),
    ],
)
def test_decode_runs_under_kv_pressure(kv_fields: dict[str, object], swap_outs: int) -> None:
    """A pool too small for the load. Runs take the preemptions as events inside them (far fewer
    `schedule` calls than preemptions), whatever the victim rule, by recompute or by swap (and
    the swapped-out requests' swap-ins; a swap without host room falls back to recompute):
    stepping's results, step records and totals, preemptions and swaps included."""
    rng = random.Random(5)
    rows = generate("tight", 120, poisson(20.0), fixed(64), uniform(40, 200), seed=5).requests
    trace = Trace("tight", tuple(dataclasses.replace(r, priority=rng.randint(0, 3)) for r in rows), "s", "test")
    kv = KVConfig(num_blocks=120, block_size=16, **kv_fields)  # type: ignore[arg-type]
    config = SchedulerConfig(max_num_batched_tokens=512, kv=kv)
    stepped_log, skipped_log = StepLog(), StepLog()
    stepped = simulate(trace, ContinuousScheduler(config), COSTS["affine"], skip_ahead=False, observers=[stepped_log])
    scheduled: list[float] = []

    def check(scheduler: object, out: object, now: float) -> None:
        check_invariants(scheduler)  # type: ignore[arg-type]
        scheduled.append(now)

    skipped = simulate(trace, ContinuousScheduler(config), COSTS["affine"], inspect=check, observers=[skipped_log])
    preemptions = stepped.scheduler_stats["num_preemptions"]
    assert isinstance(preemptions, int) and preemptions > 20, "the pool was meant to be too small"
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped_log.rows == stepped_log.rows
    assert skipped.busy_time == stepped.busy_time and skipped.kv_usage_mean == stepped.kv_usage_mean
    assert stepped.scheduler_stats["num_swap_outs"] == stepped.scheduler_stats["num_swap_ins"] == swap_outs
    assert len(scheduled) < preemptions / 4


def test_decode_runs_cover_the_seed_semantics() -> None:
    """The seed preset (a prefill samples nothing; unit cost): one long request and arrivals that
    join runs give the results, totals and step records of stepping, in a few runs."""
    rows = [TraceRequest("long", 0.0, 4, 3000)] + [TraceRequest(f"r{i}", 5.0 * i, 3, 7) for i in range(1, 40)]
    trace = Trace("seed-long", tuple(rows), "tick", "test")
    cost = COSTS["unit"]
    calls: list[float] = []
    stepped_log, skipped_log = StepLog(), StepLog()
    stepped = simulate(trace, ContinuousScheduler(seed_config()), cost, skip_ahead=False, observers=[stepped_log])
    skipped = simulate(
        trace, ContinuousScheduler(seed_config()), cost, inspect=lambda *a: calls.append(a[2]), observers=[skipped_log]
    )
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped_log.rows == stepped_log.rows and skipped.busy_time == stepped.busy_time
    assert len(calls) < skipped.num_steps / 20


@st.composite
def long_traces(draw: st.DrawFn) -> Trace:
    """Few requests with long outputs: decode segments of hundreds of steps, cut by arrivals and,
    with clients, by cancellations."""
    clients = draw(st.booleans())
    requests = []
    for i in range(draw(st.integers(1, 6))):
        output = draw(st.integers(1, 600))
        arrival = float(draw(st.integers(0, 400))) * draw(st.sampled_from([0.01, 1.0]))
        cancel_after = draw(st.sampled_from([None, None, 0.5, 3.0, 40.0])) if clients else None
        requests.append(
            TraceRequest(
                f"r{i}",
                arrival,
                draw(st.integers(1, 40)),
                output,
                max_output_tokens=output + draw(st.sampled_from([0, 7])),
                cancel_ts=None if cancel_after is None else arrival + cancel_after,
            )
        )
    return Trace("long", tuple(sorted(requests, key=lambda r: r.arrival_ts)), "s", "hypothesis")


@settings(max_examples=settings().max_examples, deadline=None, derandomize=True)
@given(trace=long_traces(), config=configs(), cost_name=st.sampled_from(sorted(COSTS)))
def test_unobserved_long_segments_equal_stepping(trace: Trace, config: SchedulerConfig, cost_name: str) -> None:
    """Without observers, long decode segments are timed with vectorised arithmetic
    (`skip_ahead._RunDriver._timed_at_once`; every step at once under the unit cost's
    `FixedPrice`): the same results as stepping, and the same totals to the last bit."""
    trace = _fits(trace, config)
    if not trace.requests:
        return
    cost = COSTS[cost_name]
    if cost_name == "moe":
        cost.reset_stats()  # type: ignore[attr-defined]
    stepped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=False)
    skipped = simulate(trace, ContinuousScheduler(config), cost, inspect=lambda s, o, n: check_invariants(s))
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped.busy_time == stepped.busy_time
    assert (skipped.kv_usage_mean, skipped.kv_usage_max) == (stepped.kv_usage_mean, stepped.kv_usage_max)


@pytest.mark.interpreted  # spies on `_RunDriver._timed_at_once`
def test_long_segments_are_timed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorised path is taken (generic pricers and `FixedPrice`), and under the seed preset
    with the unit cost one long request takes a handful of runs: equal to stepping, to the bit."""
    from contbatch.sim import skip_ahead

    taken: list[int] = []
    at_once = skip_ahead._RunDriver._timed_at_once

    def spy(self: skip_ahead._RunDriver, segment: object, price: object, first_id: int) -> object:
        result = at_once(self, segment, price, first_id)  # type: ignore[arg-type]
        taken.append(len(result[0]))
        return result

    monkeypatch.setattr(skip_ahead._RunDriver, "_timed_at_once", spy)
    rows = [TraceRequest("long", 0.0, 4, 20_000)] + [TraceRequest(f"r{i}", 700.0 * i, 3, 300) for i in range(1, 9)]
    seed_trace = Trace("seed-long", tuple(rows), "tick", "test")
    kv_trace = generate("kv", 40, poisson(2.0), uniform(20, 200), uniform(100, 600), seed=7)
    cases = [
        (seed_trace, seed_config(), COSTS["unit"]),
        (kv_trace, SchedulerConfig(max_num_batched_tokens=512, kv=KVConfig(num_blocks=600)), COSTS["roofline"]),
        (kv_trace, SchedulerConfig(max_num_batched_tokens=512, kv=KVConfig(num_blocks=600)), COSTS["affine"]),
    ]
    calls: list[float] = []
    for trace, config, cost in cases:
        taken.clear()
        calls.clear()
        stepped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=False)
        skipped = simulate(trace, ContinuousScheduler(config), cost, inspect=lambda s, o, n: calls.append(n))
        assert _fingerprint(skipped) == _fingerprint(stepped)
        assert skipped.busy_time == stepped.busy_time
        assert (skipped.kv_usage_mean, skipped.kv_usage_max) == (stepped.kv_usage_mean, stepped.kv_usage_max)
        assert sum(taken) > skipped.num_steps / 5, "long segments were meant to be timed at once"
        assert len(calls) < skipped.num_steps / 50


@st.composite
def saturating(draw: st.DrawFn) -> tuple[Trace, SchedulerConfig]:
    """Bursts that fill the pool, the seats or the budget: requests wait, long prompts are
    computed in chunks, so decode runs carry a waiting queue and a prefilling member."""
    requests = [
        TraceRequest(
            f"r{i}",
            float(draw(st.integers(0, 30))) * draw(st.sampled_from([0.01, 0.1, 1.0])),
            prompt,
            draw(st.integers(1, 50)),
            **_shared_prefix(draw, prompt),
        )
        for i, prompt in enumerate(draw(st.lists(st.sampled_from([1, 3, 17, 40, 90, 150]), min_size=2, max_size=24)))
    ]
    kv = draw(kv_configs(st.integers(40, 400), ["optimistic", "optimistic", "reserve"], [0.0, 0.01, 0.1]))
    config = SchedulerConfig(
        max_num_batched_tokens=draw(st.sampled_from([8, 32, 64, 200])),
        sample_on_prefill=draw(st.sampled_from([True, True, False])),
        max_num_seqs=draw(st.sampled_from([None, 2, 5])),
        chunked_prefill=draw(st.sampled_from([True, True, False])),
        skip_blocked=draw(st.sampled_from([False, False, True])),
        batch_buckets=draw(st.sampled_from([(), (1, 2, 4, 8, 16)])),
        queue_order=draw(st.sampled_from(["fcfs", "fcfs", "priority"])),
        kv=kv,
    )
    trace = Trace("burst", tuple(sorted(requests, key=lambda r: r.arrival_ts)), "s", "hypothesis")
    return _fits(trace, config), config


@settings(max_examples=3 * settings().max_examples, deadline=None, derandomize=True)
@given(case=saturating(), cost_name=st.sampled_from(sorted(COSTS)))
def test_saturated_runs_equal_stepping(case: tuple[Trace, SchedulerConfig], cost_name: str) -> None:
    """Runs that carry a waiting queue and a prefilling member (planned steps) give stepping's
    results, step records and totals."""
    trace, config = case
    if not trace.requests:
        return
    cost = COSTS[cost_name]
    if cost_name == "moe":
        cost.reset_stats()  # type: ignore[attr-defined]

    def check(scheduler: object, out: object, now: float) -> None:
        check_invariants(scheduler)  # type: ignore[arg-type]

    stepped_log, skipped_log = StepLog(), StepLog()
    stepped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=False, observers=[stepped_log])
    skipped = simulate(trace, ContinuousScheduler(config), cost, inspect=check, observers=[skipped_log])
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped_log.rows == stepped_log.rows
    unobserved = simulate(trace, ContinuousScheduler(config), cost)
    assert _fingerprint(unobserved) == _fingerprint(stepped)
    assert unobserved.busy_time == stepped.busy_time
    assert (unobserved.kv_usage_mean, unobserved.kv_usage_max) == (stepped.kv_usage_mean, stepped.kv_usage_max)


def _runs_equal_stepping(trace: Trace, config: SchedulerConfig) -> tuple[SimResult, list[float]]:
    """Stepping's result on the roofline cost, checked equal to skip-ahead's, and the times at
    which skip-ahead called `schedule`."""
    cost = COSTS["roofline"]
    stepped = simulate(trace, ContinuousScheduler(config), cost, skip_ahead=False)
    scheduled: list[float] = []
    skipped = simulate(trace, ContinuousScheduler(config), cost, inspect=lambda s, o, n: scheduled.append(n))
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped.busy_time == stepped.busy_time
    return stepped, scheduled


def test_saturated_traffic_is_taken_in_runs() -> None:
    """A queue that never empties and prompts longer than a step's budget: runs carry the queue
    and the chunked prefills (few `schedule` calls for many steps), with stepping's results."""
    trace = generate("saturated", 400, poisson(60.0), uniform(100, 900), uniform(5, 60), seed=9)
    kv = KVConfig(num_blocks=1200, block_size=16)
    config = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64, kv=kv)
    stepped, scheduled = _runs_equal_stepping(trace, config)
    assert sum(len(t.scheduled_ts) for t in stepped.timelines) > len(trace), "the pool was meant to be short"
    assert len(scheduled) < stepped.num_steps / 5


@pytest.mark.parametrize("shared", [False, True])
def test_prefix_caching_is_taken_in_runs(shared: bool) -> None:
    """vLLM's preset (prefix caching on) on saturated traffic, with a pool short enough to preempt
    by recompute, gives stepping's results. Prompts of their own (every block hashed with its
    request's id): runs take most steps. Two in three prompts sharing a system prompt with one of
    four groups: hits; runs take only the steps whose admissions the cache cannot decide
    (`FastForward.admits`)."""
    base = generate("pc", 300, poisson(40.0), uniform(100, 600), uniform(5, 60), seed=4)
    rng = random.Random(4)
    requests = tuple(
        dataclasses.replace(r, prefix_group=f"g{i % 4}", prefix_tokens=min(r.num_prompt_tokens, rng.choice([64, 256])))
        if shared and i % 3
        else r
        for i, r in enumerate(base.requests)
    )
    trace = dataclasses.replace(base, requests=requests)
    kv = dataclasses.replace(PRESETS["vllm"].kv, num_blocks=300)
    config = dataclasses.replace(PRESETS["vllm"], max_num_batched_tokens=1024, max_num_seqs=64, kv=kv)
    stepped, scheduled = _runs_equal_stepping(trace, config)
    stats = stepped.scheduler_stats
    assert stats["num_recompute_preemptions"] > 0 and stats["num_prefix_query_tokens"] > 0
    assert (stats["num_prefix_hit_tokens"] > 0) == shared
    assert len(scheduled) < stepped.num_steps * (0.9 if shared else 0.3)


def test_runs_split_a_recomputed_request_as_the_scheduler_does() -> None:
    """Without chunked prefill a request preempted by recompute may still be split (its prompt
    and outputs could outgrow the budget): runs plan its chunks by the scheduler's own rule."""
    rng = random.Random(3)
    kv = KVConfig(block_size=4, num_blocks=40)
    config = SchedulerConfig(max_num_batched_tokens=64, chunked_prefill=False, kv=kv)
    recomputed = 0
    for trial in range(30):
        rows = [
            TraceRequest(f"r{i}", rng.random() * 2, rng.choice([10, 30, 50]), rng.randint(20, 60))
            for i in range(rng.randint(3, 14))
        ]
        trace = _fits(Trace("split", tuple(sorted(rows, key=lambda r: r.arrival_ts)), "s", "test"), config)
        stepped = simulate(trace, ContinuousScheduler(config), COSTS["unit"], skip_ahead=False)
        skipped = simulate(trace, ContinuousScheduler(config), COSTS["unit"])
        assert _fingerprint(skipped) == _fingerprint(stepped), trial
        recomputed += int(stepped.scheduler_stats["num_recomputed_tokens"] > 0)  # type: ignore[operator]
    assert recomputed > 10


def test_a_recomputation_ends_with_a_decode_in_runs_too() -> None:
    """A request preempted by recompute computes all it knew again, and its last known position
    is a decode (it samples): a run's planned step counts it as stepping does (found by the
    `thorough` Hypothesis profile)."""
    outputs = {"r1": 11, "r5": 12, "r7": 11}
    rows = [TraceRequest(f"r{i}", 0.0, 3 if i == 1 else 1, outputs.get(f"r{i}", 1)) for i in range(1, 24)]
    trace = Trace("burst", (*rows, TraceRequest("r0", 0.01, 1, 7)), "s", "test")
    config = SchedulerConfig(max_num_batched_tokens=8, kv=KVConfig(block_size=1, num_blocks=40))
    stepped_log, skipped_log = StepLog(), StepLog()
    stepped = simulate(trace, ContinuousScheduler(config), COSTS["unit"], skip_ahead=False, observers=[stepped_log])
    skipped = simulate(trace, ContinuousScheduler(config), COSTS["unit"], observers=[skipped_log])
    assert stepped.scheduler_stats["num_recompute_preemptions"] == 1
    assert _fingerprint(skipped) == _fingerprint(stepped)
    assert skipped_log.rows == stepped_log.rows
