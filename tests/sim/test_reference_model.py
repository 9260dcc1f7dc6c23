"""contbatch against an independent reference model of the specification's simulator.

The reference below is the seed's `static_batching` / `continuous_batching`, written again from
the specification (no contbatch scheduler code), generalised to any capacity C and to steps that
cost ceil(token-work / C) ticks, at least 1:

- static: all arrived requests form one batch; its prefill prices the padded prompt tokens
  (batch size x longest prompt); every decode tick prices every batch slot, idle ones included,
  and emits one token for each unfinished member at the tick's end; nothing joins until the
  whole batch is done; with nothing ready the clock jumps to the next arrival.
- continuous: each tick has budget C: active requests decode first in admission order, one
  token-work each; then waiting requests, in arrival order, whose whole prompt fits what is left
  are admitted (prefill, no token); the ones that do not fit are skipped. A token is emitted at
  the end of its decode tick, so the first one comes one tick after the prefill tick. A tick's
  work never exceeds C, so every tick costs 1; with nothing ready the clock jumps.

Hypothesis then checks that `simulate` with `seed_config(C)` and `UnitCost(C)` reproduces every
request's token times (first token and completion included) and the static padding exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    SchedulerBase,
    SchedulerConfig,
    StaticScheduler,
    seed_config,
)
from contbatch.sim.cost import UnitCost
from contbatch.sim.loop import simulate
from contbatch.traces import Trace, TraceRequest


@dataclass
class Ref:
    name: str
    arrival: int
    prompt: int
    output: int
    emitted: list[int] = field(default_factory=list)
    completed: int | None = None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ticks(work: int, capacity: int) -> int:
    return max(1, ceil_div(work, capacity))


@dataclass(frozen=True)
class Knobs:
    """Beyond the seed (whose values are the defaults): a slot limit, first token sampled by the
    prefill tick, strict queue order. A request finishing in a tick holds its slot in that tick."""

    max_seqs: int | None = None
    sample_on_prefill: bool = False
    skip_blocked: bool = True


SEED_KNOBS = Knobs()


def emit(r: Ref, ts: int) -> bool:
    """Emit one token at `ts`; True when it was the last one."""
    r.emitted.append(ts)
    if len(r.emitted) == r.output:
        r.completed = ts
        return True
    return False


def ref_static(trace: list[Ref], capacity: int, knobs: Knobs = SEED_KNOBS) -> tuple[list[Ref], int]:
    reqs = [Ref(r.name, r.arrival, r.prompt, r.output) for r in trace]
    time = waste = 0
    pending = reqs[:]
    while pending:
        ready = [r for r in pending if r.arrival <= time]
        if not ready:
            time = min(r.arrival for r in pending)
            ready = [r for r in pending if r.arrival <= time]
        batch = ready[: knobs.max_seqs]
        for r in batch:
            pending.remove(r)
        padded = len(batch) * max(r.prompt for r in batch)
        waste += padded - sum(r.prompt for r in batch)
        time += ticks(padded, capacity)
        if knobs.sample_on_prefill:
            for r in batch:
                emit(r, time)
        decode_ticks = ticks(len(batch), capacity)  # every slot, idle or not, is token-work
        while any(r.completed is None for r in batch):
            for r in batch:
                if r.completed is None:
                    emit(r, time + decode_ticks)
                else:
                    waste += 1
            time += decode_ticks
    return reqs, waste


def ref_continuous(trace: list[Ref], capacity: int, knobs: Knobs = SEED_KNOBS) -> list[Ref]:
    reqs = [Ref(r.name, r.arrival, r.prompt, r.output) for r in trace]
    time = 0
    pending = reqs[:]
    active: list[Ref] = []
    while pending or active:
        if not active and all(r.arrival > time for r in pending):
            time = min(r.arrival for r in pending)  # nothing to do until the next arrival
        budget = capacity
        slots = len(active)  # finishing requests still hold their slot during this tick
        for r in active[:]:
            if budget == 0:
                break
            budget -= 1
            if emit(r, time + 1):
                active.remove(r)
        for r in [r for r in pending if r.arrival <= time]:
            if knobs.max_seqs is not None and slots >= knobs.max_seqs:
                break
            if r.prompt > budget:
                if knobs.skip_blocked:
                    continue
                break
            budget -= r.prompt
            slots += 1
            pending.remove(r)
            if not (knobs.sample_on_prefill and emit(r, time + 1)):
                active.append(r)
        time += 1
    return reqs


# -- the reference itself reproduces the specification's numbers -----------------------------------
SEED_TRACE = [Ref("A", 0, 4, 5), Ref("B", 0, 2, 2), Ref("C", 3, 3, 4)]


def test_reference_reproduces_the_seed() -> None:
    static, waste = ref_static(SEED_TRACE, 8)
    assert {r.name: r.completed for r in static} == {"A": 6, "B": 3, "C": 11}
    assert waste == 5
    cont = ref_continuous(SEED_TRACE, 8)
    assert {r.name: r.completed for r in cont} == {"A": 6, "B": 3, "C": 8}
    assert {r.name: r.emitted[0] - r.arrival for r in cont} == {"A": 2, "B": 2, "C": 2}


def test_reference_static_prices_batches_larger_than_capacity() -> None:
    # 5 requests at C=2: prefill 5 x 3 = 15 token-work -> 8 ticks; each decode 5 slots -> 3 ticks
    reqs, waste = ref_static([Ref(f"r{i}", 0, 3 if i == 0 else 1, 2 if i == 0 else 1) for i in range(5)], 2)
    assert [r.emitted for r in reqs] == [[11, 14], [11], [11], [11], [11]]
    assert waste == 4 * 2 + 4  # prompt padding, then 4 idle slots in the second decode tick


# -- contbatch == reference ------------------------------------------------------------------------
def to_trace(refs: list[Ref]) -> Trace:
    return Trace("gen", tuple(TraceRequest(r.name, r.arrival, r.prompt, r.output) for r in refs), "tick", "test")


def run(refs: list[Ref], scheduler: SchedulerBase, capacity: int) -> tuple[dict[str, list[float]], int]:
    result = simulate(to_trace(refs), scheduler, UnitCost(capacity))
    for tl in result.timelines:
        assert tl.finish_reason is FinishReason.LENGTH
        assert tl.token_counts == [1] * len(tl.token_counts)
        assert tl.finished_ts == tl.token_ts[-1]
    return {tl.request_id: list(tl.token_ts) for tl in result.timelines}, result.padding_tokens


@st.composite
def traces(draw: st.DrawFn) -> tuple[int, list[Ref]]:
    capacity = draw(st.integers(2, 10))
    n = draw(st.integers(1, 12))
    refs = [
        Ref(f"r{i}", draw(st.integers(0, 15)), draw(st.integers(1, capacity)), draw(st.integers(1, 8)))
        for i in range(n)
    ]
    refs.sort(key=lambda r: r.arrival)  # stable, as Trace sorts: ties keep their order
    return capacity, refs


def config(capacity: int, knobs: Knobs) -> SchedulerConfig:
    return dataclasses.replace(
        seed_config(capacity),
        max_num_seqs=knobs.max_seqs,
        sample_on_prefill=knobs.sample_on_prefill,
        skip_blocked=knobs.skip_blocked,
    )


def check_static(capacity: int, refs: list[Ref], knobs: Knobs = SEED_KNOBS) -> None:
    expected, waste = ref_static(refs, capacity, knobs)
    got, padding = run(refs, StaticScheduler(config(capacity, knobs)), capacity)
    for r in expected:
        assert got[r.name][0] == r.emitted[0], f"{r.name}: first token"
        assert got[r.name][-1] == r.completed, f"{r.name}: completion"
        assert got[r.name] == r.emitted, f"{r.name}: token times"
    assert padding == waste


def check_continuous(capacity: int, refs: list[Ref], knobs: Knobs = SEED_KNOBS) -> None:
    expected = ref_continuous(refs, capacity, knobs)
    got, padding = run(refs, ContinuousScheduler(config(capacity, knobs)), capacity)
    for r in expected:
        assert got[r.name][0] == r.emitted[0], f"{r.name}: first token"
        assert got[r.name][-1] == r.completed, f"{r.name}: completion"
        assert got[r.name] == r.emitted, f"{r.name}: token times"
    assert padding == 0


@settings(
    max_examples=4 * settings().max_examples,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(traces())
def test_contbatch_matches_the_reference(case: tuple[int, list[Ref]]) -> None:
    capacity, refs = case
    max_batch = max(sum(1 for r in refs if r.arrival <= t) for t in range(16))
    event("some static batch may exceed C" if max_batch > capacity else "batches within C")
    check_static(capacity, refs)
    check_continuous(capacity, refs)


@pytest.mark.parametrize("capacity", [2, 3, 8])
def test_large_simultaneous_batches(capacity: int) -> None:
    refs = [Ref(f"r{i}", 0, 1 + i % capacity, 1 + i % 5) for i in range(12)]
    refs += [Ref(f"late{i}", 4 + i, capacity, 3) for i in range(3)]
    check_static(capacity, refs)
    check_continuous(capacity, refs)


knobs = st.builds(
    Knobs,
    max_seqs=st.none() | st.integers(1, 4),
    sample_on_prefill=st.booleans(),
    skip_blocked=st.booleans(),
)


@settings(
    max_examples=3 * settings().max_examples,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(traces(), knobs)
def test_contbatch_matches_the_generalised_reference(case: tuple[int, list[Ref]], knobs: Knobs) -> None:
    """The same check beyond the seed preset: a slot limit, engine sampling, strict order."""
    capacity, refs = case
    check_static(capacity, refs, knobs)
    check_continuous(capacity, refs, knobs)


def test_strict_order_in_the_reference() -> None:
    # C=4: r0 decodes (1), r1 (prompt 4) cannot fit, r2 (prompt 1) passes only when skipping
    refs = [Ref("r0", 0, 4, 3), Ref("r1", 1, 4, 1), Ref("r2", 1, 1, 1)]
    skip = {r.name: r.emitted for r in ref_continuous(refs, 4)}
    strict = {r.name: r.emitted for r in ref_continuous(refs, 4, Knobs(skip_blocked=False))}
    assert skip == {"r0": [2, 3, 4], "r1": [6], "r2": [3]}
    assert strict == {"r0": [2, 3, 4], "r1": [6], "r2": [7]}  # r2 waits behind r1
    check_continuous(4, refs, Knobs(skip_blocked=False))
    check_continuous(4, refs)
