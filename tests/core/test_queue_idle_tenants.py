"""The fair queue keeps state for the active tenants only (issue 15): after 100,000 distinct
tenants have come and gone its state is bounded by a constant, and the work of a step with a few
backlogged tenants does not grow with the number of tenants seen. Sizes and operation counts are
asserted, never wall time. The order it offers equals a naive model of the same rules (VTC
counters, the lift of a newly backlogged tenant, the virtual time, the bounded idle memory)."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from typing import Any

import pytest

from contbatch.core import ContinuousScheduler, SchedulerConfig, StepResult
from contbatch.core import queue as orders
from contbatch.core.queue import FairQueue
from contbatch.core.request import Request

NUM_TENANTS = 100_000


def step(s: ContinuousScheduler, now: float) -> None:
    out = s.schedule(now)
    s.update(out, StepResult(sampled_token_ids={c.request_id: (0,) for c in out.chunks if c.samples}), now + 0.5)


def footprint(q: FairQueue) -> dict[str, int]:
    """White box: the sizes of everything the queue keeps."""
    return {"backlog": len(q._backlog), "heap": len(q._heap), "idle": len(q._idle), "order": len(q._order)}


class CountingHeapq:
    """Stands in for `heapq` inside the queue module and counts the heap operations."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(heapq, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return real(*args)

        return counted


def test_100k_tenants_through_the_scheduler_leave_constant_state(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=1024, queue_order="fair")
    s = ContinuousScheduler(config)
    q = s.waiting
    assert isinstance(q, FairQueue)
    # a few long-lived tenants stay backlogged all along; 100,000 others come once each
    regulars = ("r0", "r1", "r2")
    seq = 0

    def add(tenant: str, now: float) -> None:
        nonlocal seq
        s.add_request(Request(f"q{seq}", now, 2, 1, tenant=tenant), now)
        seq += 1

    largest = dict.fromkeys(("backlog", "heap", "idle", "order"), 0)
    per_wave = 1000
    for wave in range(NUM_TENANTS // per_wave):
        now = float(wave)
        for i in range(per_wave):
            add(f"t{wave * per_wave + i}", now)
        for tenant in regulars:
            add(tenant, now)
        step(s, now)
        size = footprint(q)
        largest = {k: max(v, size[k]) for k, v in largest.items()}
        assert size["heap"] <= 2 * size["backlog"] + 64
        assert size["idle"] <= FairQueue.IDLE_MEMORY
    while s.has_unfinished():
        step(s, 1e6)
    assert s.num_finished == NUM_TENANTS + 3 * (NUM_TENANTS // per_wave)
    # drained: nothing backlogged, the heap cleared of stale entries up to its slack, the idle
    # memory at its bound: a constant, not a function of the 100,000 tenants seen
    assert not q and len(q) == 0 and list(q) == []
    size = footprint(q)
    assert size["backlog"] == size["order"] == 0
    assert size["heap"] <= 64 and size["idle"] <= FairQueue.IDLE_MEMORY
    assert len(q.counters) <= FairQueue.IDLE_MEMORY
    assert largest["backlog"] <= per_wave + len(regulars)

    # a step with three backlogged tenants costs as many heap operations as on a fresh queue
    def heap_ops(queue: FairQueue) -> int:
        counting = CountingHeapq()
        monkeypatch.setattr(orders, "heapq", counting)
        for i in range(30):
            queue.push(Request(f"x{i}", 0.0, 2, 1, tenant=f"a{i % 3}"))
        offered = []
        for r in queue.candidates(0.0):
            offered.append(r)
            queue.admitted(r)
        queue.remove(offered)
        monkeypatch.setattr(orders, "heapq", heapq)
        assert len(offered) == 30 and not queue
        return counting.calls

    fresh = FairQueue({})
    assert heap_ops(q) <= heap_ops(fresh) + 64  # + the stale entries a compaction may have left


def test_a_queue_full_of_distinct_tenants_drains_to_constant_state() -> None:
    # 100,000 tenants backlogged at once (one request each), then served in FIFO-like fashion
    q = FairQueue({}, idle_memory=16)
    requests = [Request(f"r{i}", 0.0, 1, 1, tenant=f"t{i}") for i in range(NUM_TENANTS)]
    for r in requests:
        q.push(r)
    assert len(q) == NUM_TENANTS and footprint(q)["backlog"] == NUM_TENANTS
    served = 0
    while q:
        batch = []
        for r in q.candidates(0.0):
            q.admitted(r)
            batch.append(r)
            if len(batch) == 5000:
                break
        q.remove(batch)
        served += len(batch)
    assert served == NUM_TENANTS
    assert footprint(q) == {"backlog": 0, "heap": footprint(q)["heap"], "idle": 16, "order": 0}
    assert footprint(q)["heap"] <= 64
    assert q.vtime == 1.0  # every tenant was charged its one prompt token: the virtual time is 1


def test_a_forgotten_tenant_comes_back_at_the_virtual_time_not_at_zero() -> None:
    q = FairQueue({}, idle_memory=1)
    a, b, c = (Request(f"{t}0", 0.0, 10, 1, tenant=t) for t in "abc")
    q.push(a)
    q.push(b)
    q.admitted(a)
    q.admitted(b)  # a: 10, b: 10
    q.charge(a, 30)  # a: 40
    q.remove([b])  # b drains at 10: the virtual time is min(40, 10) = 10
    assert q.vtime == 10.0 and dict(q.counters) == {"a": 40.0, "b": 10.0}
    q.remove([a])  # a drains at 40 (the only one left): vtime 40; b is forgotten (memory of 1)
    assert q.vtime == 40.0 and dict(q.counters) == {"a": 40.0}
    q.push(c)  # nobody backlogged: c, never seen, starts at the virtual time
    assert q.counters["c"] == 40.0
    q.charge(b, 5)  # b, forgotten, is charged from the virtual time
    assert q.counters["b"] == 45.0


def test_an_idle_tenant_keeps_its_debt_while_remembered() -> None:
    q = FairQueue({})
    heavy, light = Request("h0", 0.0, 100, 1, tenant="h"), Request("l0", 0.0, 1, 1, tenant="l")
    q.push(heavy)
    q.admitted(heavy)
    q.remove([heavy])  # h has nothing waiting, but its running request keeps being charged
    q.charge(heavy, 50)
    q.push(light)
    q.push(Request("h1", 0.0, 1, 1, tenant="h"))
    assert q.counters["h"] == 150.0 and q.counters["l"] == 100.0  # l starts at the virtual time
    assert [r.request_id for r in q.candidates(0.0)] == ["l0", "h1"]


# -- the naive model ----------------------------------------------------------------------------
class Naive:
    """The same rules by brute force: every backlogged tenant scanned for each candidate."""

    def __init__(self, idle_memory: int, weights: dict[str, float]) -> None:
        self.queues: dict[str | None, list[Request]] = {}
        self.counters: dict[str | None, float] = {}
        self.episode: dict[str | None, int] = {}
        self.idle: dict[str | None, float] = {}
        self.vtime = 0.0
        self.memory = idle_memory
        self.weights = weights
        self.seq = 0

    def remember(self, tenant: str | None, value: float) -> None:
        self.idle.pop(tenant, None)
        self.idle[tenant] = value
        while len(self.idle) > self.memory:
            del self.idle[next(iter(self.idle))]

    def push(self, r: Request, front: bool = False) -> None:
        t = r.tenant
        if t not in self.queues:
            floor = min(self.counters.values()) if self.counters else self.vtime
            self.counters[t] = max(self.idle.pop(t, self.vtime), floor)
            self.queues[t] = []
            self.episode[t] = self.seq
            self.seq += 1
        if front:
            self.queues[t].insert(0, r)
        else:
            self.queues[t].append(r)

    def remove(self, rs: list[Request]) -> None:
        tenants = list(dict.fromkeys(r.tenant for r in rs))
        gone = {id(r) for r in rs}
        for t in tenants:
            self.queues[t] = [r for r in self.queues[t] if id(r) not in gone]
            if not self.queues[t]:
                self.vtime = max(self.vtime, min(self.counters.values()))
                del self.queues[t], self.episode[t]
                self.remember(t, self.counters.pop(t))

    def charge(self, tenant: str | None, n: int) -> None:
        cost = n / self.weights.get(tenant or "", 1.0)
        if tenant in self.counters:
            self.counters[tenant] += cost
        else:
            self.remember(tenant, self.idle.get(tenant, self.vtime) + cost)

    def candidates(self) -> Iterator[Request]:
        offered = dict.fromkeys(self.queues, 0)
        while True:
            open_ = [t for t in self.queues if offered[t] < len(self.queues[t])]
            if not open_:
                return
            t = min(open_, key=lambda t: (self.counters[t], t or "", self.episode[t]))
            offered[t] += 1
            yield self.queues[t][offered[t] - 1]


@pytest.mark.parametrize("seed", range(12))
def test_the_heap_queue_offers_what_the_naive_model_offers(seed: int) -> None:
    rng = random.Random(seed)
    weights = {"t1": 2.0, "t3": 0.5}
    memory = rng.choice([0, 2, 5, 1024])
    fast, naive = FairQueue(weights, idle_memory=memory), Naive(memory, weights)
    tenants: list[str | None] = [None, "", *(f"t{i}" for i in range(8))]
    queued: list[Request] = []
    for i in range(400):
        op = rng.random()
        if op < 0.4:
            r = Request(f"r{i}", float(i), rng.randint(1, 20), 1, tenant=rng.choice(tenants))
            front = rng.random() < 0.2
            (fast.push_front if front else fast.push)(r)
            naive.push(r, front)
            queued.append(r)
        elif op < 0.55 and queued:
            rs = rng.sample(queued, rng.randint(1, min(4, len(queued))))
            fast.remove(rs)
            naive.remove(rs)
            queued = [r for r in queued if all(r is not x for x in rs)]
        elif op < 0.7:
            t = rng.choice(tenants)
            n = rng.randint(1, 30)
            fast.charge(Request("charged", 0.0, 1, 1, tenant=t), n)
            naive.charge(t, n)
        else:  # a scheduling pass: offer, admit some (charging their prompts), stop early at times
            stop = rng.randint(1, 12)
            got, want = [], []
            for r, w in zip(fast.candidates(0.0), naive.candidates(), strict=False):
                got.append(r.request_id)
                want.append(w.request_id)
                if r is not w or len(got) >= stop:
                    break
                if rng.random() < 0.6:
                    fast.admitted(r)
                    naive.charge(r.tenant, r.num_prompt_tokens)
            assert got == want, (seed, i)
        assert dict(fast.counters) == {**naive.counters, **naive.idle}, (seed, i)
        assert fast.vtime == naive.vtime and len(fast) == len(queued)
        assert list(fast._idle) == list(naive.idle)  # the same tenants forgotten, in the same order
