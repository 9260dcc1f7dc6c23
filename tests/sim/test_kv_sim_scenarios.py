"""Paged-KV features through whole simulated runs (`contbatch.sim.simulate`), `check_invariants`
after every step (`on_step`).

Covers: never-fit requests rejected while the rest of the trace completes; a large request that
would starve behind passing small ones and `max_skip_age`; bucket padding as padding waste;
speculative decoding in timelines and ITL metrics; swaps priced by the cost model; prefix groups.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    SchedulerBase,
    SchedulerConfig,
    SchedulerOutput,
    check_invariants,
)
from contbatch.core.config import KVConfig
from contbatch.core.timeline import Timeline
from contbatch.metrics import request_metrics, summarize
from contbatch.sim import AffineCost, SimResult, UnitCost, simulate
from contbatch.traces import Trace, TraceRequest


def trace(*requests: TraceRequest, unit: str = "tick") -> Trace:
    return Trace("test", tuple(requests), unit, "hand-written")


def run(
    tr: Trace, config: SchedulerConfig, cost: object = None, **kw: object
) -> tuple[SimResult, list[SchedulerOutput]]:
    outs: list[SchedulerOutput] = []

    def on_step(s: SchedulerBase, out: SchedulerOutput, now: float) -> None:
        check_invariants(s)
        outs.append(out)

    s = ContinuousScheduler(config)
    # skip_ahead off: every step passes through on_step (a skipped-ahead span reports once)
    res = simulate(tr, s, cost or UnitCost(8), inspect=on_step, skip_ahead=False, **kw)  # type: ignore[arg-type]
    assert s.memory is None or s.memory.kv.num_used_blocks == 0
    return res, outs


def by_id(res: SimResult) -> dict[str, Timeline]:
    return {tl.request_id: tl for tl in res.timelines}


# -- never fit ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "big", "kind", "word"),
    [
        ({}, TraceRequest("big", 1.0, 30, 3), "kv_capacity", "blocks"),  # 33 tokens > 8 x 4
        ({"max_model_len": 20}, TraceRequest("big", 1.0, 15, 6), "max_model_len", "max_model_len"),
        ({"chunked_prefill": False}, TraceRequest("big", 1.0, 20, 1), "token_budget", "budget"),
    ],
)
def test_a_request_that_can_never_run_is_rejected_and_the_rest_completes(
    overrides: dict[str, object], big: TraceRequest, kind: str, word: str
) -> None:
    kv = KVConfig(block_size=4, num_blocks=8, watermark=0.0)
    config = dataclasses.replace(SchedulerConfig(max_num_batched_tokens=16, kv=kv), **overrides)  # type: ignore[arg-type]
    others = [TraceRequest(f"r{i}", float(i), 6, 4, max_output_tokens=8) for i in range(4)]
    res, _ = run(trace(*others, big), config)
    tls = by_id(res)
    rejected = tls["big"]
    assert rejected.finish_reason is FinishReason.REJECTED
    assert rejected.finished_ts == 1.0 and not rejected.scheduled_ts
    assert res.scheduler_stats["rejections"] == {kind: 1}
    for spec in others:  # they stop at their output length, below their limit: STOP
        tl = tls[spec.request_id]
        assert tl.finish_reason is FinishReason.STOP and tl.num_output_tokens == 4
    summary = summarize(res.timelines, time_unit=res.time_unit)
    assert summary["completed"] == 4


def test_never_fit_detail_names_the_blocks() -> None:
    kv = KVConfig(block_size=4, num_blocks=8)
    s = ContinuousScheduler(SchedulerConfig(kv=kv))
    simulate(trace(TraceRequest("big", 0.0, 30, 3)), s, UnitCost(8))
    assert s.stats.rejections == {"kv_capacity": 1}


# -- starvation and max_skip_age ----------------------------------------------------------------
def _starvation_trace() -> Trace:
    """Small requests (prompt 1, 4 outputs) arrive every tick until t=29; 'big' (prompt 8, the
    whole budget, no chunking) arrives at t=1 and fits only in a step with nothing else."""
    smalls = [TraceRequest(f"s{t:02d}", float(t), 1, 4) for t in range(30)]
    return trace(*smalls, TraceRequest("big", 1.0, 8, 2))


def _starvation(max_skip_age: float | None) -> dict[str, Timeline]:
    config = SchedulerConfig(
        max_num_batched_tokens=8, chunked_prefill=False, skip_blocked=True, max_skip_age=max_skip_age,
        kv=KVConfig(block_size=4, num_blocks=64, watermark=0.0),
    )  # fmt: skip
    res, _ = run(_starvation_trace(), config)
    tls = by_id(res)
    assert all(tl.finish_reason is FinishReason.LENGTH for tl in res.timelines)
    return tls


def test_a_blocked_large_request_starves_while_small_ones_pass() -> None:
    tls = _starvation(None)
    big = tls["big"]
    # it runs only once the stream has ended and the last small request (t=29..32) has drained
    assert big.scheduled_ts == [33.0] and big.finished_ts == 35.0
    assert tls["s29"].scheduled_ts == [29.0]


@pytest.mark.parametrize("age", [0.0, 2.0, 5.0])
def test_max_skip_age_stops_the_passing_and_the_large_request_runs(age: float) -> None:
    tls = _starvation(age)
    big = tls["big"]
    # s01 is ahead of big in the queue (same arrival, earlier in the trace); s02 .. s{age} pass
    # while big's age (now - 1) is below the limit; big runs when the last of them has drained
    # (4 steps of 1 tick) and nobody passes any more
    last_passer = max(1, int(age))
    assert big.scheduled_ts == [1.0 + last_passer + 3.0] and big.finished_ts == big.scheduled_ts[0] + 2.0
    for t in range(2, 30):
        admitted = tls[f"s{t:02d}"].scheduled_ts[0]
        if t <= last_passer:
            assert admitted == float(t)  # passed big
        else:
            assert admitted >= big.scheduled_ts[0]


# -- buckets ------------------------------------------------------------------------------------
def test_bucket_padding_is_padding_waste() -> None:
    config = SchedulerConfig(max_num_batched_tokens=16, batch_buckets=(4, 8, 12),
                             kv=KVConfig(block_size=4, num_blocks=32, watermark=0.0))  # fmt: skip
    tr = trace(*(TraceRequest(f"r{i}", float(i), 3 + 4 * i, 3) for i in range(4)))
    cost = UnitCost(4)
    res, outs = run(tr, config, cost)
    expected = []
    for out in outs:
        n = out.num_batched_tokens
        bucket = next((b for b in (4, 8, 12) if b >= n), None)
        expected.append(0 if bucket is None else bucket - n)
    assert [o.num_padding_tokens for o in outs] == expected
    assert sum(expected) > 0 and any(o.num_batched_tokens > 12 for o in outs)  # both cases happen
    assert res.padding_tokens == sum(expected) == res.scheduler_stats["num_bucket_padding_tokens"]
    assert summarize(res.timelines, time_unit=res.time_unit, padding_tokens=res.padding_tokens)["padding_waste"] == (
        sum(expected)
    )
    # the unit cost prices the padding as token-work
    assert res.busy_time == sum(math.ceil((o.num_batched_tokens + o.num_padding_tokens) / 4) for o in outs)


# -- speculative decoding -----------------------------------------------------------------------
def _spec(acceptance: float) -> tuple[SimResult, list[SchedulerOutput]]:
    config = SchedulerConfig(max_num_batched_tokens=8, num_speculative_tokens=3,
                             kv=KVConfig(block_size=2, num_blocks=32, watermark=0.0))  # fmt: skip
    return run(trace(TraceRequest("a", 0.0, 4, 10)), config, UnitCost(8), acceptance_rate=acceptance)


def test_speculation_with_every_draft_accepted() -> None:
    res, outs = _spec(1.0)
    assert [o.num_batched_tokens for o in outs] == [4, 4, 4, 1]
    (tl,) = res.timelines
    assert tl.token_counts == [1, 4, 4, 1] and tl.token_ts == [1.0, 2.0, 3.0, 4.0]
    m = request_metrics(tl)
    assert m.itl_per_emission == (1.0, 1.0, 1.0)
    assert m.itl_per_token == (0.25,) * 8 + (1.0,)
    assert sorted(m.itl_per_token) != sorted(m.itl_per_emission) and m.num_emissions == 4 and m.num_output_tokens == 10
    assert m.tpot == pytest.approx(3.0 / 9)
    st = res.scheduler_stats
    assert (st["num_draft_tokens"], st["num_accepted_draft_tokens"], st["draft_acceptance_rate"]) == (6, 6, 1.0)


def test_speculation_with_no_draft_accepted() -> None:
    res, outs = _spec(0.0)
    assert [o.num_batched_tokens for o in outs] == [4, 4, 4, 4, 4, 4, 4, 3, 2, 1]
    (tl,) = res.timelines
    assert tl.token_counts == [1] * 10
    m = request_metrics(tl)
    assert m.itl_per_token == m.itl_per_emission == (1.0,) * 9
    st = res.scheduler_stats
    assert (st["num_draft_tokens"], st["num_accepted_draft_tokens"], st["draft_acceptance_rate"]) == (21, 0, 0.0)


def test_speculation_with_partial_acceptance_is_seeded() -> None:
    first, _ = _spec(0.5)
    again, _ = _spec(0.5)
    (tl,) = first.timelines
    assert tl.token_counts == again.timelines[0].token_counts and sum(tl.token_counts) == 10
    st = first.scheduler_stats
    assert 0 < st["num_accepted_draft_tokens"] < st["num_draft_tokens"]  # type: ignore[operator]


# -- swap in a whole run ------------------------------------------------------------------------
def test_swap_runs_price_the_swapped_blocks() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, kv=KVConfig(block_size=2, num_blocks=8, watermark=0.0,
                                                                   preemption="swap", num_host_blocks=64))  # fmt: skip
    tr = trace(*(TraceRequest(f"r{i}", 0.0, 2, 6) for i in range(3)), unit="s")
    res, outs = run(tr, config, AffineCost())
    st = res.scheduler_stats
    assert st["num_swap_outs"] >= 1 and st["num_swap_ins"] == st["num_swap_outs"]  # type: ignore[operator]
    moved = sum(o.num_swapped_blocks for o in outs)
    assert moved == st["num_swapped_out_blocks"] + st["num_swapped_in_blocks"]  # type: ignore[operator]
    assert st["num_recomputed_tokens"] == 0
    assert all(tl.finish_reason is FinishReason.LENGTH and tl.num_output_tokens == 6 for tl in res.timelines)
    swap_fields = [f.name for f in dataclasses.fields(AffineCost) if "swap" in f.name]
    if not swap_fields:
        pytest.skip("AffineCost has no swap parameter")
    free, _ = run(tr, config, AffineCost(**{name: 0.0 for name in swap_fields}))
    assert res.busy_time > free.busy_time
    if swap_fields == ["swap_ms_per_block"]:
        extra = AffineCost().swap_ms_per_block * moved / 1000.0
        assert res.busy_time - free.busy_time == pytest.approx(extra)


# -- prefix groups ------------------------------------------------------------------------------
def test_prefix_group_members_share_their_full_blocks() -> None:
    config = SchedulerConfig(kv=KVConfig(block_size=4, num_blocks=64, enable_prefix_caching=True))
    tr = trace(
        TraceRequest("a", 0.0, 20, 2, prefix_group="sys", prefix_tokens=10),
        TraceRequest("b", 5.0, 14, 2, prefix_group="sys", prefix_tokens=10),
        TraceRequest("c", 5.0, 14, 2),  # no group: no hits
    )
    res, outs = run(tr, config)
    st = res.scheduler_stats
    # 10 shared tokens = 2 full blocks of 4; b's first chunk starts at 8
    assert (st["num_prefix_query_tokens"], st["num_prefix_hit_tokens"]) == (48, 8)
    b_first = next(c for o in outs for c in o.chunks if c.request_id == "b")
    assert (b_first.start, b_first.num_new_tokens) == (8, 6)


# -- a lone request always runs (stalls at commit 974b9fd) -------------------------------------
def test_estimate_runs_a_lone_request_that_fits_the_pool() -> None:
    config = SchedulerConfig(kv=KVConfig(block_size=4, num_blocks=2, admission="estimate", watermark=0.0))
    res, _ = run(trace(TraceRequest("a", 0.0, 5, 3)), config)
    assert res.timelines[0].finish_reason is FinishReason.LENGTH


def test_watermark_does_not_stall_a_request_that_fits_the_pool() -> None:
    config = SchedulerConfig(kv=KVConfig(block_size=4, num_blocks=10, watermark=0.1))
    res, _ = run(trace(TraceRequest("a", 0.0, 38, 2), TraceRequest("b", 0.0, 30, 2)), config)
    assert all(tl.finish_reason is FinishReason.LENGTH for tl in res.timelines)


# -- skip-ahead spans agree with stepping under a KV budget -------------------------------------
def _snapshot(res: SimResult) -> list[tuple[object, ...]]:
    return [
        (tl.request_id, tuple(tl.scheduled_ts), tuple(tl.preempted_ts), tuple(tl.token_ts), tuple(tl.token_counts),
         tl.finished_ts, tl.finish_reason)
        for tl in res.timelines
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kv",
    [
        KVConfig(block_size=4, num_blocks=12, watermark=0.0),  # optimistic, preempts
        KVConfig(block_size=4, num_blocks=12, admission="reserve"),
        KVConfig(block_size=4, num_blocks=12, admission="estimate", watermark=0.05),
        KVConfig(block_size=4, num_blocks=12, preemption="swap", num_host_blocks=32, watermark=0.0),
    ],
)
def test_skip_ahead_gives_the_same_run_as_stepping(kv: KVConfig) -> None:
    config = SchedulerConfig(max_num_batched_tokens=32, batch_buckets=(4, 8, 16), kv=kv)
    tr = trace(
        *(TraceRequest(f"r{i}", float(3 * i), 6 + i, 12 + 2 * i, max_output_tokens=16 + 2 * i) for i in range(6))
    )
    stepped, _ = run(tr, config)
    s = ContinuousScheduler(config)
    skipped = simulate(tr, s, UnitCost(8), inspect=lambda sch, out, now: check_invariants(sch))
    assert _snapshot(skipped) == _snapshot(stepped)
    assert (skipped.padding_tokens, skipped.busy_time) == (stepped.padding_tokens, stepped.busy_time)
    assert skipped.scheduler_stats == stepped.scheduler_stats
    assert s.memory is not None and s.memory.kv.num_used_blocks == 0
