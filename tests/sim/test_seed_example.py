"""The specification's worked example, A=(0,4,5), B=(0,2,2), C=(3,3,4) at 8 token-work per tick,
replayed through `simulate` with the seed preset and both schedulers (docs/design.md,
"Scheduling semantics")."""

from __future__ import annotations

import statistics

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    SchedulerBase,
    SchedulerOutput,
    StaticScheduler,
    check_invariants,
    seed_config,
)
from contbatch.sim.cost import UnitCost
from contbatch.sim.loop import SimResult, simulate
from contbatch.traces import Trace, TraceRequest

SEED = Trace(
    "seed-example",
    (TraceRequest("A", 0, 4, 5), TraceRequest("B", 0, 2, 2), TraceRequest("C", 3, 3, 4)),
    "tick",
    "contbatch specification worked example",
)

EXPECTED = {
    "static": {
        "completion": {"A": 6, "B": 3, "C": 11},
        "ttft": {"A": 2, "B": 2, "C": 5},
        "padding": 5,
        "makespan": 11,
        "throughput": 1.0,
    },
    "continuous": {
        "completion": {"A": 6, "B": 3, "C": 8},
        "ttft": {"A": 2, "B": 2, "C": 2},
        "padding": 0,
        "makespan": 8,
        "throughput": 1.375,
    },
}


def run(cls: type[SchedulerBase]) -> SimResult:
    def check(s: SchedulerBase, *_: object) -> None:
        check_invariants(s)

    return simulate(SEED, cls(seed_config()), UnitCost(8), inspect=check)


@pytest.mark.parametrize("cls", [StaticScheduler, ContinuousScheduler])
def test_seed_worked_example(cls: type[SchedulerBase]) -> None:
    result = run(cls)
    want = EXPECTED[result.scheduler]
    tls = {tl.request_id: tl for tl in result.timelines}
    assert result.time_unit == "tick"
    assert [tl.request_id for tl in result.timelines] == ["A", "B", "C"]
    assert {rid: tl.finished_ts for rid, tl in tls.items()} == want["completion"]
    assert {rid: tl.first_token_ts - tl.arrival_ts for rid, tl in tls.items()} == want["ttft"]
    assert all(tl.finish_reason is FinishReason.LENGTH for tl in tls.values())
    assert {rid: tl.num_output_tokens for rid, tl in tls.items()} == {"A": 5, "B": 2, "C": 4}
    for tl in tls.values():  # TPOT 1: one token per tick after the first
        assert statistics.mean(b - a for a, b in zip(tl.token_ts, tl.token_ts[1:], strict=False)) == 1.0
        assert (tl.token_ts[-1] - tl.token_ts[0]) / (tl.num_output_tokens - 1) == 1.0
    assert result.padding_tokens == want["padding"]
    makespan = max(tl.finished_ts for tl in tls.values()) - min(tl.arrival_ts for tl in tls.values())
    assert makespan == want["makespan"]
    assert sum(tl.num_output_tokens for tl in tls.values()) / makespan == want["throughput"]


def test_seed_token_times() -> None:
    static = {tl.request_id: tl.token_ts for tl in run(StaticScheduler).timelines}
    cont = {tl.request_id: tl.token_ts for tl in run(ContinuousScheduler).timelines}
    assert static == {"A": [2, 3, 4, 5, 6], "B": [2, 3], "C": [8, 9, 10, 11]}
    assert cont == {"A": [2, 3, 4, 5, 6], "B": [2, 3], "C": [5, 6, 7, 8]}


def test_continuous_prefills_c_while_a_decodes() -> None:
    steps: list[tuple[float, list[tuple[str, int, bool]]]] = []

    def record(_: SchedulerBase, out: SchedulerOutput, now: float) -> None:
        steps.append((now, [(c.request_id, c.num_new_tokens, c.is_prefill) for c in out.chunks]))

    # every step's chunks: stepped (decode runs leave steady decodes out of their step shapes)
    simulate(SEED, ContinuousScheduler(seed_config()), UnitCost(8), inspect=record, skip_ahead=False)
    assert steps[3] == (4.0, [("A", 1, False), ("C", 3, True)])  # the step that starts at t=3
