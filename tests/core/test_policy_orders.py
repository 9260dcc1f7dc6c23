"""Queue orders (`contbatch.core.queue`), unit by unit and through the scheduler stepped by hand.

- fcfs: arrival order; a preempted request goes back to the front.
- priority: lower value first, ties by arrival (not by insertion), a preempted request keeps its key.
- deadline: earliest deadline first, requests without a deadline last, ties by arrival.
- aging: key priority + rate x arrival, so a low-priority request is overtaken only by requests
  arriving less than (p - p') / rate after it (a tie goes to the earlier arrival), and the order
  equals the effective priority p - rate x (now - arrival) at every now.
- shortest: key prompt tokens + rate x arrival, so a long prompt is overtaken only by shorter ones
  arriving less than (L - L') / rate after it; through the scheduler a burst is admitted shortest
  first.
- fair (VTC): prompt charged at first admission (not again after a preemption), each output token
  charged, both divided by the tenant's weight; a tenant becoming backlogged is lifted to the
  smallest counter of the backlogged tenants (never lowered); candidates go to the backlogged
  tenant with the smallest counter, re-read after every admission, so admissions alternate.
"""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    Request,
    SchedulerConfig,
    SchedulerOutput,
)
from contbatch.core.config import KVConfig, TenantConfig
from contbatch.core.queue import FairQueue, KeyedQueue, WaitingQueue, make_queue

from .drive import step


def ids(requests: object) -> list[str]:
    return [r.request_id for r in requests]  # type: ignore[attr-defined]


def admitted_ids(out: SchedulerOutput) -> list[str]:
    """Requests whose chunk starts at position 0: the newly admitted ones, in admission order."""
    return [c.request_id for c in out.chunks if c.start == 0]


def order(name: str, *, rate: float = 1.0, weights: dict[str, float] | None = None) -> WaitingQueue:
    return make_queue(name, aging_rate=rate, tenant_weights=weights or {})


def test_make_queue_picks_the_class_and_refuses_unknown_orders() -> None:
    assert type(order("fcfs")) is WaitingQueue
    assert all(isinstance(order(n), KeyedQueue) for n in ("priority", "deadline", "aging", "shortest"))
    assert isinstance(order("fair"), FairQueue)
    with pytest.raises(ValueError, match="unknown queue order 'lifo'"):
        order("lifo")


# -- fcfs ---------------------------------------------------------------------------------------
def test_fcfs_is_arrival_order_and_push_front_goes_first() -> None:
    q = order("fcfs")
    for i in range(3):
        q.push(Request(f"r{i}", float(i), 1, 1, priority=2 - i))
    q.push_front(Request("back", 9.0, 1, 1))
    assert ids(q.candidates(0.0)) == ids(q) == ["back", "r0", "r1", "r2"]


def test_fcfs_preempted_request_returns_to_the_front_of_the_queue() -> None:
    # a KV pool of 4 one-token blocks: a (prompt 2) and b (prompt 2) fill it; a's growth preempts
    # b (the newest), which must be ahead of c, queued before the preemption.
    config = SchedulerConfig(max_num_batched_tokens=16, kv=KVConfig(block_size=1, num_blocks=4, watermark=0.0))
    s = ContinuousScheduler(config)
    for rid, prompt in (("a", 2), ("b", 2), ("c", 1)):
        s.add_request(Request(rid, 0.0, prompt, 2), 0.0)
    step(s, 0.0)  # a, b prefill and sample (4 blocks used); c waits, the pool is full
    assert ids(s.running) == ["a", "b"] and ids(s.waiting) == ["c"]
    out = step(s, 1.0)  # a and b both need a 5th and 6th block: b is preempted, a decodes
    assert out.preempted_ids == ("b",)
    assert ids(s.waiting) == ["b", "c"]


# -- priority -----------------------------------------------------------------------------------
def test_priority_lower_value_first_ties_by_arrival_not_insertion() -> None:
    q = order("priority")
    rows = [("late-0", 5.0, 0), ("p2", 0.0, 2), ("early-0", 1.0, 0), ("p1", 2.0, 1), ("first-0", 0.5, 0)]
    for rid, arrival, priority in rows:
        q.push(Request(rid, arrival, 1, 1, priority=priority))
    assert ids(q.candidates(0.0)) == ["first-0", "early-0", "late-0", "p1", "p2"]


def test_priority_push_front_keeps_the_key_and_wins_ties_by_early_arrival() -> None:
    q = order("priority")
    q.push(Request("hi", 3.0, 1, 1, priority=0))
    q.push(Request("lo", 1.0, 1, 1, priority=1))
    q.push_front(Request("preempted", 2.0, 1, 1, priority=1))  # keeps priority 1: not ahead of "hi"
    q.push_front(Request("old", 0.0, 1, 1, priority=1))
    assert ids(q) == ["hi", "old", "lo", "preempted"]


def test_priority_order_through_the_scheduler() -> None:
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, queue_order="priority"))
    for rid, priority in (("c", 2), ("a", 0), ("b", 1), ("a2", 0)):
        s.add_request(Request(rid, 0.0, 1, 1, priority=priority), 0.0)
    order_run = [admitted_ids(step(s, float(t)))[0] for t in range(4)]
    assert order_run == ["a", "a2", "b", "c"]


# -- deadline -----------------------------------------------------------------------------------
def test_deadline_is_earliest_first_none_last_ties_by_arrival() -> None:
    q = order("deadline")
    rows = [("none-a", 0.0, None), ("d9", 1.0, 9.0), ("d3-late", 2.0, 3.0), ("d3", 1.5, 3.0), ("none-b", 0.5, None)]
    for rid, arrival, deadline in rows:
        q.push(Request(rid, arrival, 1, 1, deadline_ts=deadline, priority=-5 if deadline is None else 5))
    assert ids(q.candidates(100.0)) == ["d3", "d3-late", "d9", "none-a", "none-b"]


# -- aging --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.5, 2.0])
def test_aging_low_priority_is_overtaken_only_by_arrivals_within_dp_over_rate(rate: float) -> None:
    q = order("aging", rate=rate)
    low = Request("low", 10.0, 1, 1, priority=6)
    q.push(low)
    window = 6 / rate  # (p - p') / rate with p' = 0
    for rid, offset in (("inside", window * 0.99), ("tie", window), ("outside", window * 1.01), ("same", 0.0)):
        q.push(Request(rid, 10.0 + offset, 1, 1, priority=0))
    # "same" and "inside" overtake; "tie" has an equal key and the earlier arrival (low) wins
    assert ids(q) == ["same", "inside", "low", "tie", "outside"]


def test_aging_order_is_the_effective_priority_at_any_time() -> None:
    rate = 0.75
    q = order("aging", rate=rate)
    rows = [(0.0, 4), (1.0, 3), (2.5, 1), (3.0, 0), (6.0, 0), (0.5, 5), (8.0, -1)]
    requests = [Request(f"r{i}", a, 1, 1, priority=p) for i, (a, p) in enumerate(rows)]
    for r in requests:
        q.push(r)
    for now in (8.0, 20.0, 1000.0):
        effective = sorted(requests, key=lambda r: (r.priority - rate * (now - r.arrival_ts), r.arrival_ts))
        assert ids(q.candidates(now)) == ids(effective)


def test_aging_versus_priority_through_the_scheduler() -> None:
    # "low" (priority 3) waits from t=0; a priority-0 request arrives at every step. With rate 1
    # the arrivals at t=0, 1, 2 overtake it (key 0, 1, 2 < 3), the one at t=3 ties and loses.
    def run(queue_order: str) -> list[str]:
        s = ContinuousScheduler(
            SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, queue_order=queue_order, aging_rate=1.0)
        )
        s.add_request(Request("low", 0.0, 1, 1, priority=3), 0.0)
        served = []
        for t in range(6):
            s.add_request(Request(f"h{t}", float(t), 1, 1, priority=0), float(t))
            served += admitted_ids(step(s, float(t)))
        return served

    assert run("aging") == ["h0", "h1", "h2", "low", "h3", "h4"]
    assert run("priority") == ["h0", "h1", "h2", "h3", "h4", "h5"]


# -- shortest -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.5, 2.0])
def test_shortest_long_prompt_is_overtaken_only_by_arrivals_within_dl_over_rate(rate: float) -> None:
    q = order("shortest", rate=rate)
    long = Request("long", 10.0, 100, 1)
    q.push(long)
    window = (100 - 40) / rate  # (L - L') / rate with L' = 40
    for rid, offset in (("inside", window * 0.99), ("tie", window), ("outside", window * 1.01), ("same", 0.0)):
        q.push(Request(rid, 10.0 + offset, 40, 1))
    # "same" and "inside" overtake; "tie" has an equal key and the earlier arrival (long) wins
    assert ids(q) == ["same", "inside", "long", "tie", "outside"]


def test_shortest_orders_a_burst_by_prompt_length_ties_by_arrival() -> None:
    q = order("shortest")
    lengths = {"a": 300, "b": 120, "c": 300, "d": 7, "e": 120}
    for i, (rid, n) in enumerate(lengths.items()):
        q.push(Request(rid, 5.0 + i * 1e-6, n, 1))
    assert ids(q.candidates(5.0)) == ["d", "b", "e", "a", "c"]


def test_shortest_admits_a_burst_shortest_first_through_the_scheduler() -> None:
    # budget 64: shortest first, 10 + 20 + 30 whole and 4 tokens of the 50-token prompt; fcfs: the
    # 50-token prompt whole and 14 tokens of the 30-token one
    def run(queue_order: str) -> list[tuple[str, int]]:
        s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64, queue_order=queue_order))
        for rid, n in (("p50", 50), ("p30", 30), ("p10", 10), ("p20", 20)):
            s.add_request(Request(rid, 0.0, n, 4), 0.0)
        return [(c.request_id, c.num_new_tokens) for c in step(s, 0.0).chunks]

    assert run("shortest") == [("p10", 10), ("p20", 20), ("p30", 30), ("p50", 4)]
    assert run("fcfs") == [("p50", 50), ("p30", 14)]


# -- fair ---------------------------------------------------------------------------------------
def fair(**weights: float) -> FairQueue:
    q = order("fair", weights=weights)
    assert isinstance(q, FairQueue)
    return q


def test_fair_charges_prompt_once_and_outputs_divided_by_weight() -> None:
    q = fair(a=2.0)
    a = Request("a0", 0.0, 10, 5, tenant="a")
    b = Request("b0", 0.0, 10, 5, tenant="b")
    q.push(a)
    q.push(b)
    q.admitted(a)
    q.admitted(b)
    assert dict(q.counters) == {"a": 5.0, "b": 10.0}
    q.charge(a, 3)
    q.charge(b, 3)
    assert dict(q.counters) == {"a": 6.5, "b": 13.0}
    a.num_preemptions = 1  # re-admission after a preemption: recomputation is not new service
    q.admitted(a)
    assert q.counters["a"] == 6.5


def test_fair_counters_through_the_scheduler_are_prompt_plus_outputs_over_weight() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, queue_order="fair", tenants=TenantConfig(weights=(("a", 4.0),)))
    s = ContinuousScheduler(config)
    s.add_request(Request("a0", 0.0, 8, 3, tenant="a"), 0.0)
    s.add_request(Request("b0", 0.0, 6, 2, tenant="b"), 0.0)
    s.add_request(Request("x", 0.0, 5, 1), 0.0)  # no tenant: weight 1, its own counter
    assert isinstance(s.waiting, FairQueue)
    step(s, 0.0)  # all admitted (charged prompts), each samples its first token
    assert dict(s.waiting.counters) == {"a": (8 + 1) / 4, "b": 6 + 1, None: 5 + 1}
    while s.has_unfinished():
        step(s, 1.0)
    assert dict(s.waiting.counters) == {"a": (8 + 3) / 4, "b": 6 + 2, None: 5 + 1}


def test_fair_new_backlog_is_lifted_to_the_min_backlogged_counter_never_lowered() -> None:
    q = fair()
    reqs = {rid: Request(rid, 0.0, 1, 1, tenant=rid[0]) for rid in ("a0", "a1", "b0", "b1", "c0", "d0")}
    q.push(reqs["a0"])
    q.push(reqs["b0"])
    q.charge(reqs["a0"], 40)
    q.charge(reqs["b0"], 25)
    q.push(reqs["c0"])  # c becomes backlogged: lifted to min(40, 25)
    assert q.counters["c"] == 25.0
    q.charge(reqs["d0"], 100)  # d has been served much while idle: it keeps its counter
    q.push(reqs["d0"])
    assert q.counters["d"] == 100.0
    q.push(reqs["a1"])  # a is already backlogged: no lift, no change
    assert q.counters["a"] == 40.0
    q.remove([reqs["b0"]])  # b drains; a later push lifts b to the min of the others (25: c)
    q.push(reqs["b1"])
    assert q.counters["b"] == 25.0


def test_fair_queue_with_nobody_backlogged_starts_at_zero() -> None:
    q = fair()
    r = Request("a0", 0.0, 1, 1, tenant="a")
    q.push(r)
    assert dict(q.counters) == {"a": 0.0}


def test_fair_candidates_follow_the_smallest_counter_and_are_lazily_reordered() -> None:
    q = fair()
    reqs = [Request(f"{t}{i}", float(i), 4, 1, tenant=t) for i in range(3) for t in "ab"]
    for r in reqs:
        q.push(r)
    # without admissions in between, the counters stay equal: tenant a (first by name) is drained
    assert ids(q.candidates(0.0)) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    # admitting each candidate as it is offered re-sorts the tenants: they alternate
    offered = []
    for r in q.candidates(0.0):
        offered.append(r.request_id)
        q.admitted(r)
    assert offered == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_fair_admissions_alternate_between_tenants_through_the_scheduler() -> None:
    def run(weights: tuple[tuple[str, float], ...]) -> list[str]:
        config = SchedulerConfig(max_num_batched_tokens=64, queue_order="fair", tenants=TenantConfig(weights=weights))
        s = ContinuousScheduler(config)
        for i in range(3):
            for t in "ab":
                s.add_request(Request(f"{t}{i}", 0.0, 4, 1, tenant=t), 0.0)
        out = step(s, 0.0)
        assert not s.has_unfinished()
        return admitted_ids(out)

    assert run(()) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    # a weighs 2: each of its prompts costs 2, b's cost 4 (counters before each pick in brackets):
    # a0 [0,0] b0 [2,0] a1 [2,4] a2 [4,4: tie, a by name] b1 [6,4] b2 [6,8]
    assert run((("a", 2.0),)) == ["a0", "b0", "a1", "a2", "b1", "b2"]


def test_fair_heavy_tenant_cannot_starve_a_light_one_through_the_scheduler() -> None:
    # one slot; tenant h queues 6 requests first, then l queues 2: after h0 (charged 2 + 1), l is
    # served before h again, though all of h's requests arrived earlier.
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, queue_order="fair")
    s = ContinuousScheduler(config)
    for i in range(6):
        s.add_request(Request(f"h{i}", 0.0, 2, 1, tenant="h"), 0.0)
    for i in range(2):
        s.add_request(Request(f"l{i}", 0.0, 2, 1, tenant="l"), 0.0)
    served = [admitted_ids(step(s, float(t)))[0] for t in range(8)]
    assert served == ["h0", "l0", "h1", "l1", "h2", "h3", "h4", "h5"]
    assert not s.has_unfinished()
