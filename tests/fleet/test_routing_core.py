"""The routing core (`contbatch.routing`): each router's rule, deterministic tie-breaking, one
state per router instance (a prefill and a decode pool never share a round-robin counter),
bounded load for prefix affinity, stable hashing across processes, the registry's errors, and the
gateway's own accounting (`LoadTracker`) under random event sequences."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contbatch.routing import (
    ROUTERS,
    LoadTracker,
    PrefixAffinity,
    ReplicaView,
    RouteRequest,
    RouterSpecError,
    Scrape,
    chain,
    make_router,
    text_block_keys,
    token_block_keys,
)
from contbatch.routing.routers import NoReplica


def req(rid: str = "r", prompt: int = 100, out: int = 10, keys: tuple[int, ...] = ()) -> RouteRequest:
    return RouteRequest(rid, prompt, out, keys)


def views(*loads: int, kv: tuple[float, ...] = ()) -> list[ReplicaView]:
    out = []
    for i, load in enumerate(loads):
        scrape = Scrape(0.0, 0, load, kv[i]) if kv else None
        out.append(ReplicaView(f"r{i}", num_in_flight=load, scrape=scrape))
    return out


def test_round_robin_has_its_own_counter_per_instance() -> None:
    prefill, decode = make_router("round_robin"), make_router("round_robin")
    vs = views(0, 0, 0)
    picks = [(prefill.choose(req(), vs), decode.choose(req(), vs)) for _ in range(4)]
    assert picks == [(0, 0), (1, 1), (2, 2), (0, 0)]  # each pool cycles through all of its replicas


def test_least_outstanding_ties_go_to_the_lowest_index() -> None:
    router = make_router("least_outstanding")
    assert router.choose(req(), views(3, 1, 1, 2)) == 1
    assert router.choose(req(), views(0, 0)) == 0


def test_least_kv_reads_the_scrape_then_in_flight() -> None:
    router = make_router("least_kv")
    assert router.needs_scrape
    assert router.choose(req(), views(5, 1, 2, kv=(0.1, 0.5, 0.1))) == 2  # equal KV: fewer in flight
    assert router.choose(req(), views(5, 1, 2, kv=(0.05, 0.5, 0.1))) == 0
    assert router.choose(req(), views(5, 1, 2, kv=(0.3, 0.3, 0.3))) == 1


def test_least_work_prices_each_replica() -> None:
    slow = {"r0": 3.0, "r1": 1.0}

    def pricer(rid: str, prefill: int, decode: int, batch: int) -> float:
        return slow[rid] * (prefill + decode)

    router = make_router("least_work", pricer=pricer)
    vs = [ReplicaView("r0"), ReplicaView("r1", pending_prompt_tokens=150)]
    assert router.choose(req(prompt=100), vs) == 1  # 3 * 100 > 1 * 250
    vs[1].pending_prompt_tokens = 250
    assert router.choose(req(prompt=100), vs) == 0  # 300 < 350


def test_prefix_affinity_keeps_a_prefix_together_and_spills_at_the_bound() -> None:
    router = make_router("prefix_affinity:load=1.25,blocks=2")
    keys = chain([1, 2, 3])
    vs = views(0, 0, 0, 0)
    first = router.choose(req(keys=keys), vs)
    assert all(router.choose(req(f"x{i}", keys=keys), vs) == first for i in range(5))
    vs[first].num_in_flight = 10  # over 1.25 x the mean: the next replica clockwise takes it
    assert router.choose(req(keys=keys), vs) != first
    other = chain([1, 2, 99])  # same first two blocks: same key
    vs[first].num_in_flight = 0
    assert router.choose(req(keys=other), vs) == first


@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.lists(st.integers(0, 2**64 - 1), max_size=4))
def test_bounded_load_never_exceeds_the_bound(loads: list[int], keys: list[int]) -> None:
    router = PrefixAffinity(load=1.25)
    vs = views(*loads)
    i = router.choose(req(keys=tuple(keys)), vs)
    assert vs[i].num_in_flight < router.capacity(vs)


def test_consistent_hashing_moves_few_keys_when_a_replica_joins() -> None:
    router = PrefixAffinity(load=100.0)
    requests = [req(f"k{i}", keys=chain([i])) for i in range(400)]
    before = [router.choose(r, views(0, 0, 0, 0)) for r in requests]
    after = [router.choose(r, views(0, 0, 0, 0, 0)) for r in requests]
    moved = sum(1 for a, b in zip(before, after, strict=True) if a != b)
    assert all(b == a for a, b in zip(before, after, strict=True) if b != 4)  # only moves to the new one
    assert moved < 0.35 * len(requests)


def test_weighted_combines_scorers_and_remembers_prefixes() -> None:
    router = make_router("weighted:prefix=3,load=1")
    keys = chain([7, 8, 9, 10])
    vs = views(0, 0, 0)
    first = router.choose(req("a", keys=keys), vs)
    assert first == 0  # nothing known: load ties, lowest index
    vs[0].num_in_flight = 2
    assert router.choose(req("b", keys=keys), vs) == 0  # the prefix (3) outweighs the load (1)
    assert router.choose(req("c", keys=chain([1, 2])), vs) == 1  # no prefix anywhere: least loaded


def test_same_input_same_decision_for_every_router() -> None:
    for name in ROUTERS:
        spec = "weighted:prefix=1,queue=1,kv=1,load=1,work=1" if name == "weighted" else name
        a, b = make_router(spec), make_router(spec)
        for i in range(20):
            vs = views(i % 3, (i * 7) % 5, 2, kv=(0.2, 0.1 * (i % 4), 0.3))
            r = req(f"q{i}", prompt=50 + i, keys=chain([i % 3, i]))
            assert a.choose(r, vs) == b.choose(r, vs), name


def test_no_replica_is_an_error() -> None:
    with pytest.raises(NoReplica):
        make_router("least_outstanding").choose(req(), [])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown router 'nope'"),
        ("round_robin:x=1", "takes no parameters"),
        ("prefix_affinity:load=0.5", "load >= 1"),
        ("prefix_affinity:bogus=1", "unknown parameter 'bogus'"),
        ("prefix_affinity:load=abc", "not a number"),
        ("weighted", "needs scorers"),
        ("weighted:magic=1", "unknown scorer 'magic'"),
        ("weighted:kv=0", "must be > 0"),
        ("weighted:kv", "expected KEY=VALUE"),
    ],
)
def test_registry_errors_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(RouterSpecError, match=message):
        make_router(spec)


def test_hashing_is_stable_across_processes() -> None:
    code = (
        "from contbatch.routing import text_block_keys, make_router, RouteRequest, ReplicaView;"
        "r = make_router('prefix_affinity');"
        "print(text_block_keys('abcdefgh' * 8, 16)[-1], r.choose(RouteRequest('id-1', 5, 5), "
        "[ReplicaView(f'rep-{i}') for i in range(7)]))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_block_keys_are_chained() -> None:
    a = token_block_keys(list(range(40)), 8)
    b = token_block_keys([*range(16), *range(100, 124)], 8)
    assert len(a) == 5 and a[:2] == b[:2] and a[2] != b[2]
    assert text_block_keys("x" * 33, 16) == text_block_keys("x" * 32, 16)


events = st.lists(
    st.tuples(st.sampled_from(["route", "first", "tokens", "finish"]), st.integers(0, 9), st.integers(0, 2)),
    max_size=60,
)


@given(events)
def test_tracker_counts_equal_its_requests(steps: list[tuple[str, int, int]]) -> None:
    tracker = LoadTracker()
    for i in range(3):
        tracker.add_replica(f"r{i}")
    for kind, rid, replica in steps:
        name = f"q{rid}"
        if kind == "route" and tracker.replica_of(name) is None:
            tracker.routed(RouteRequest(name, 10 + rid, 1 + rid), f"r{replica}")
        elif kind == "first":
            tracker.first_token(name)
        elif kind == "tokens":
            tracker.tokens(name, replica + 1)
        else:
            tracker.finished(name)
        tracker.check()
        assert all(v.num_in_flight >= 0 and v.decode_tokens >= 0 for v in tracker.views())
    with pytest.raises(ValueError, match="in flight"):
        busy = [v.replica_id for v in tracker.views() if v.num_in_flight]
        if not busy:
            raise ValueError("nothing in flight")
        tracker.remove_replica(busy[0])
