"""Queue orders end to end in the simulator: deadlines (EDF), aging versus strict priority, and the
built-in `priority-mix` trace.

Hand-built traces use one server (`max_num_seqs=1`), the unit cost (one tick per step of at most 8
tokens) and one-token prompts: a request with n output tokens takes exactly n ticks (the prefill
step samples the first token, then n - 1 decodes), so every completion time is known exactly.
"""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.core import ContinuousScheduler, SchedulerConfig, check_invariants, preset_config
from contbatch.metrics import summarize
from contbatch.metrics.groups import summarize_by
from contbatch.sim import AffineCost, SimResult, UnitCost, simulate
from contbatch.traces import Trace, TraceRequest
from contbatch.traces.scenarios import priority_mix


def one_server(queue_order: str, **kw: object) -> ContinuousScheduler:
    return ContinuousScheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, queue_order=queue_order, **kw)  # type: ignore[arg-type]
    )


def run(trace: Trace, scheduler: ContinuousScheduler) -> SimResult:
    return simulate(trace, scheduler, UnitCost(), inspect=lambda s, out, now: check_invariants(s))


# -- deadlines ----------------------------------------------------------------------------------
# arrival order A, B, C, D (all at t=0); lengths 4, 3, 2, 3 ticks; deadlines 12, 7, 2, 10.
# EDF runs C [0,2] B [2,5] D [5,8] A [8,12]: every deadline met (A exactly at 12).
# FCFS runs A [0,4] B [4,7] C [7,9] D [9,12]: C and D miss.
DEADLINE_ROWS = (("A", 4, 12.0), ("B", 3, 7.0), ("C", 2, 2.0), ("D", 3, 10.0))
DEADLINE_TRACE = Trace(
    "edf", tuple(TraceRequest(rid, 0.0, 1, n, deadline_ts=d) for rid, n, d in DEADLINE_ROWS), "tick", "hand-built"
)


def test_the_deadline_trace_is_feasible_and_not_in_deadline_order() -> None:
    by_deadline = sorted(DEADLINE_ROWS, key=lambda row: row[2])
    assert [row[0] for row in by_deadline] != [row[0] for row in DEADLINE_ROWS]
    finish = 0
    for _, length, deadline in by_deadline:
        finish += length
        assert finish <= deadline


@pytest.mark.parametrize(
    ("queue_order", "finished", "attainment", "misses"),
    [
        ("deadline", {"A": 12.0, "B": 5.0, "C": 2.0, "D": 8.0}, 1.0, 0),
        ("fcfs", {"A": 4.0, "B": 7.0, "C": 9.0, "D": 12.0}, 0.5, 2),
    ],
)
def test_edf_meets_every_deadline_fcfs_misses(
    queue_order: str, finished: dict[str, float], attainment: float, misses: int
) -> None:
    result = run(DEADLINE_TRACE, one_server(queue_order))
    assert {t.request_id: t.finished_ts for t in result.timelines} == finished
    summary = summarize(result.timelines, time_unit="tick")
    assert summary["num_deadline_requests"] == 4
    assert summary["deadline_attainment"] == attainment and summary["num_deadline_misses"] == misses


def test_requests_without_deadline_go_after_those_with_one() -> None:
    rows = (TraceRequest("free", 0.0, 1, 2), TraceRequest("due", 0.0, 1, 2, deadline_ts=50.0))
    result = run(Trace("t", rows, "tick", "hand-built"), one_server("deadline"))
    assert {t.request_id: t.scheduled_ts[0] for t in result.timelines} == {"free": 2.0, "due": 0.0}
    summary = summarize(result.timelines, time_unit="tick")
    assert summary["num_deadline_requests"] == 1 and summary["deadline_attainment"] == 1.0


# -- aging versus strict priority -----------------------------------------------------------------
# "low" (priority 10) arrives at t=0; priority-0 requests h0..h59 arrive every 1.5 ticks and take 2
# ticks each: the server is saturated and a backlog of them builds up.
LOW_PRIORITY, SERVICE, GAP, NUM_HIGH = 10, 2.0, 1.5, 60
AGING_TRACE = Trace(
    "aging",
    (
        TraceRequest("low", 0.0, 1, 3, priority=LOW_PRIORITY),
        *(TraceRequest(f"h{i}", GAP * i, 1, int(SERVICE), priority=0) for i in range(NUM_HIGH)),
    ),
    "tick",
    "hand-built",
)


def first_scheduled(result: SimResult, rid: str) -> float:
    (tl,) = (t for t in result.timelines if t.request_id == rid)
    return tl.scheduled_ts[0]


def test_strict_priority_starves_the_low_request_until_the_stream_ends() -> None:
    result = run(AGING_TRACE, one_server("priority"))
    last_high = max(t.finished_ts or 0.0 for t in result.timelines if t.request_id != "low")
    assert last_high == NUM_HIGH * SERVICE  # back to back from t=0
    assert first_scheduled(result, "low") == last_high  # after every one of the stream


@pytest.mark.parametrize("rate", [2.0, 0.5, 0.25])
def test_aging_serves_the_low_request_within_the_bound_of_its_rate(rate: float) -> None:
    # Keys: low 10 + rate x 0, h_i 0 + rate x 1.5 i. Only arrivals before W = (10 - 0) / rate
    # overtake low (an equal key loses: low arrived first). From W on, low waits only for the
    # requests already ahead of it and not yet finished: the high requests served back to back
    # from t=0 have finished floor(W / 2) by W, so the bound is W + 2 x (ahead - floor(W / 2)).
    window = LOW_PRIORITY / rate
    ahead = sum(1 for i in range(NUM_HIGH) if GAP * i < window)
    finished_by_window = int(window // SERVICE)
    bound = window + SERVICE * max(0, ahead - finished_by_window)
    result = run(AGING_TRACE, one_server("aging", aging_rate=rate))
    start = first_scheduled(result, "low")
    assert start <= bound
    assert start == SERVICE * ahead  # exactly: after the `ahead` overtaking requests, back to back
    # and nobody arriving at or after W ran before it
    for t in result.timelines:
        if t.request_id != "low" and t.arrival_ts >= window:
            assert t.scheduled_ts[0] > start
    strict = run(AGING_TRACE, one_server("priority"))
    assert start < first_scheduled(strict, "low")


# -- the built-in priority-mix trace --------------------------------------------------------------
def p99_by_priority(queue_order: str) -> dict[str, float]:
    config = dataclasses.replace(preset_config("engine"), queue_order=queue_order)
    result = simulate(priority_mix(), ContinuousScheduler(config), AffineCost())
    groups = summarize_by(result.timelines, "priority", time_unit="s")
    return {p: float(g["p99_ttft_ms"]) for p, g in groups.items()}  # type: ignore[arg-type]


def test_priority_order_on_priority_mix_puts_priority_zero_first() -> None:
    fcfs, prio, aging = p99_by_priority("fcfs"), p99_by_priority("priority"), p99_by_priority("aging")
    assert list(prio) == ["0", "1", "2"]
    assert prio["0"] < prio["1"] < prio["2"]
    assert prio["0"] < fcfs["0"] / 5
    # aging (rate 1 level per second) sits between: better than fcfs for 0, worse than strict
    assert prio["0"] < aging["0"] < fcfs["0"]
    assert aging["2"] < prio["2"]
