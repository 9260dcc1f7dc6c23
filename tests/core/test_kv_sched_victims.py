"""Victim choice when a running request cannot grow: `newest`, `lowest_priority` (largest priority
value, ties to the newest), `fewest_generated` (fewest output tokens, ties to the newest), and
`max_preemptions` (a request preempted that often is chosen only when nobody else is left).

`choose_victim` is tested directly, then inside the scheduler stepped by hand with
`check_invariants` after every `update`.
"""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    Request,
    SchedulerConfig,
    check_invariants,
)
from contbatch.core.config import KVConfig
from contbatch.core.victims import choose_victim

from .drive import sampled, step


def fake(rid: str, priority: int = 0, outputs: int = 0, preemptions: int = 0) -> Request:
    r = Request(rid, 0.0, 4, 8, priority=priority)
    r.num_output_tokens = outputs
    r.num_preemptions = preemptions
    return r


# -- choose_victim ------------------------------------------------------------------------------
def test_newest_is_the_last_admitted() -> None:
    running = [fake("a"), fake("b"), fake("c")]
    assert choose_victim(running, "newest", None).request_id == "c"


@pytest.mark.parametrize(
    ("priorities", "victim"),
    [((0, 0, 0), "c"), ((1, 3, 3), "c"), ((3, 3, 1), "b"), ((5, 0, 1), "a"), ((-1, -2, -3), "a")],
)
def test_lowest_priority_is_the_largest_priority_value_ties_to_the_newest(
    priorities: tuple[int, int, int], victim: str
) -> None:
    running = [fake(rid, priority=p) for rid, p in zip("abc", priorities, strict=True)]
    assert choose_victim(running, "lowest_priority", None).request_id == victim


@pytest.mark.parametrize(
    ("outputs", "victim"), [((2, 0, 5), "b"), ((1, 0, 0), "c"), ((3, 3, 3), "c"), ((0, 1, 2), "a")]
)
def test_fewest_generated_ties_to_the_newest(outputs: tuple[int, int, int], victim: str) -> None:
    running = [fake(rid, outputs=n) for rid, n in zip("abc", outputs, strict=True)]
    assert choose_victim(running, "fewest_generated", None).request_id == victim


@pytest.mark.parametrize("policy", ["newest", "lowest_priority", "fewest_generated"])
def test_max_preemptions_protects_until_nobody_else_is_left(policy: str) -> None:
    a, b, c = fake("a", preemptions=0), fake("b", preemptions=1), fake("c", preemptions=2)
    assert choose_victim([a, b, c], policy, None) is c
    assert choose_victim([a, b, c], policy, 2) is b  # c has reached the limit
    assert choose_victim([a, b, c], policy, 1) is a  # b and c have
    a.num_preemptions = 1
    assert choose_victim([a, b, c], policy, 1) is c  # nobody fresh is left: the policy decides again


def test_max_preemptions_keeps_the_policy_order_among_the_fresh() -> None:
    running = [fake("a", priority=1), fake("b", priority=9, preemptions=3), fake("c", priority=4), fake("d")]
    assert choose_victim(running, "lowest_priority", 3).request_id == "c"
    assert choose_victim(running, "lowest_priority", 4).request_id == "b"


# -- inside the scheduler -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("victim", "priorities", "expected"),
    [
        ("newest", (0, 0, 0), "c"),  # c is the requester: it yields its own step
        ("fewest_generated", (0, 0, 0), "b"),  # b is still in its prefill: 0 outputs
        ("lowest_priority", (0, 0, 0), "c"),
        ("lowest_priority", (0, 3, 1), "b"),
        ("lowest_priority", (2, 0, 1), "a"),  # the oldest, already scheduled this step: unscheduled
        ("lowest_priority", (3, 3, 0), "b"),
    ],
)
def test_victim_policy_in_the_scheduler(victim: str, priorities: tuple[int, int, int], expected: str) -> None:
    """a and c decode, b prefills 2 tokens a step; at t=3 a grows to 3 blocks, b to 4 and c's
    third block does not fit the 9."""
    kv = KVConfig(block_size=2, num_blocks=9, watermark=0.0, victim=victim)
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=32, max_prefill_tokens_per_request=2, kv=kv))
    specs = [("a", 2, 4), ("b", 12, 2), ("c", 2, 4)]
    reqs = {}
    for (rid, prompt, limit), priority in zip(specs, priorities, strict=True):
        reqs[rid] = Request(rid, 0.0, prompt, limit, priority=priority)
        s.add_request(reqs[rid], 0.0)
    for t in range(3):
        out = step(s, float(t))
        assert [c.request_id for c in out.chunks] == ["a", "b", "c"] and not out.preempted_ids
    assert [reqs[r].num_output_tokens for r in "abc"] == [3, 0, 3]
    out = s.schedule(3.0)
    assert out.preempted_ids == (expected,)
    assert [c.request_id for c in out.chunks] == [r for r in "abc" if r != expected]
    assert s.memory is not None and s.memory.kv.num_held_blocks(expected) == 0
    assert reqs[expected].num_computed_tokens == 0 and reqs[expected].num_preemptions == 1
    s.update(out, sampled(out), 4.0)
    check_invariants(s)
    now = 4.0
    while s.has_unfinished():
        step(s, now)
        now += 1.0
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs.values())


def _protected_run(max_preemptions: int | None) -> tuple[list[tuple[float, tuple[str, ...]]], dict[str, Request]]:
    """c is preempted at t=3 (the newest), comes back at t=4 as the newest again; at t=6 b cannot
    grow. Unprotected, c is the victim again; with max_preemptions=1, b (the requester) yields."""
    kv = KVConfig(block_size=2, num_blocks=6, watermark=0.0, max_preemptions=max_preemptions)
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=32, kv=kv))
    reqs = {rid: Request(rid, arrival, prompt, limit) for rid, arrival, prompt, limit in
            [("a", 1.0, 2, 3), ("b", 2.0, 4, 5), ("c", 2.0, 2, 6)]}  # fmt: skip
    victims = []
    for t in range(30):
        for r in reqs.values():
            if r.arrival_ts == t:
                s.add_request(r, float(t))
        out = step(s, float(t))
        if out.preempted_ids:
            victims.append((float(t), out.preempted_ids))
        if t > 2 and not s.has_unfinished():
            break
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs.values())
    return victims, reqs


def test_max_preemptions_makes_the_requester_yield_instead_of_the_protected_newest() -> None:
    victims, reqs = _protected_run(None)
    assert victims == [(3.0, ("c",)), (6.0, ("c",))]
    assert reqs["c"].num_preemptions == 2 and reqs["b"].num_preemptions == 0
    victims, reqs = _protected_run(1)
    assert victims == [(3.0, ("c",)), (6.0, ("b",))]
    assert reqs["c"].num_preemptions == 1 and reqs["b"].num_preemptions == 1
