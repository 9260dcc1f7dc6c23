"""The specification's worked example, run on contbatch.

The contbatch specification ships a ~60-line discrete-event simulator comparing static and
continuous batching on three requests. This file reproduces its output with the library: the
same trace, the seed preset (one token-work per prompt or decode token, 8 per tick, the first
output token from the first decode tick after the prefill tick), the same scheduler core that
drives the real engine, and the metrics library. It prints the same lines and checks the same
numbers.

    python examples/continuous_batching_simulator.py
"""

from __future__ import annotations

import platform

from contbatch.core import ContinuousScheduler, StaticScheduler, seed_config
from contbatch.metrics import per_request_table, summarize
from contbatch.sim import UnitCost, simulate
from contbatch.traces import load_trace

CAPACITY = 8


def seed_metrics(scheduler_cls: type[StaticScheduler] | type[ContinuousScheduler]) -> dict[str, object]:
    """The seed script's metric dict, computed by contbatch."""
    trace = load_trace("seed")
    sim = simulate(trace, scheduler_cls(seed_config(CAPACITY)), UnitCost(CAPACITY))
    summary = summarize(sim.timelines, time_unit=sim.time_unit, padding_tokens=sim.padding_tokens)
    rows = per_request_table(sim.timelines)
    return {
        "makespan": summary["makespan"],
        "padding_waste": summary["padding_waste"],
        "throughput": summary["output_throughput"],
        "ttft": {m.request_id: m.ttft for m in rows},
        "tpot": {m.request_id: m.tpot if m.tpot is not None else 0.0 for m in rows},
        "completion": {m.request_id: m.completion_ts for m in rows},
        "total_output_tokens": summary["total_output_tokens"],
    }


def main() -> None:
    trace = load_trace("seed")
    static = seed_metrics(StaticScheduler)
    cont = seed_metrics(ContinuousScheduler)
    assert static["completion"] == {"A": 6, "B": 3, "C": 11}, static
    assert cont["completion"] == {"A": 6, "B": 3, "C": 8}, cont
    assert static["padding_waste"] == 5 and cont["padding_waste"] == 0
    assert static["total_output_tokens"] == cont["total_output_tokens"] == 11
    assert static["makespan"] == 11 and cont["makespan"] == 8
    assert static["throughput"] == 1.0 and cont["throughput"] == 1.375
    assert static["ttft"] == {"A": 2, "B": 2, "C": 5} and cont["ttft"] == {"A": 2, "B": 2, "C": 2}
    assert all(t == 1 for t in [*static["tpot"].values(), *cont["tpot"].values()])  # type: ignore[attr-defined]
    print(f"python={platform.python_version()} capacity={CAPACITY} token-work/tick")
    print(
        "trace=" + str([(r.request_id, r.arrival_ts, r.num_prompt_tokens, r.num_output_tokens) for r in trace.requests])
    )
    print(f"static metrics={static}")
    print(f"continuous metrics={cont}")


if __name__ == "__main__":
    main()
