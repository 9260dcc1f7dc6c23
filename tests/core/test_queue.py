"""WaitingQueue: FCFS order, push_front, and `remove` (head fast path and the general case); the
`QUEUE_ORDERS` registry and the queues' capabilities."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import pytest

from contbatch.core import ConfigError, ContinuousScheduler, SchedulerConfig, StepResult
from contbatch.core import queue as orders
from contbatch.core.queue import QUEUE_ORDERS, QueueOrder, WaitingQueue
from contbatch.core.request import Request


def make_queue(n: int) -> tuple[WaitingQueue, list[Request]]:
    queue = WaitingQueue()
    requests = [Request(f"r{i}", float(i), 1, 1) for i in range(n)]
    for request in requests:
        queue.push(request)
    return queue, requests


def ids(queue: WaitingQueue) -> list[str]:
    return [r.request_id for r in queue]


def test_push_push_front_len_bool() -> None:
    queue = WaitingQueue()
    assert not queue and len(queue) == 0
    queue, _ = make_queue(3)
    extra = Request("x", 0.0, 1, 1)
    queue.push_front(extra)
    assert queue and len(queue) == 4
    assert ids(queue) == ["x", "r0", "r1", "r2"]


def test_remove_head_fast_path_keeps_the_deque() -> None:
    queue, rs = make_queue(5)
    deque_before = queue._queue  # white box: the head path pops in place, it does not rebuild
    queue.remove([rs[1], rs[0]])  # any order of the head requests
    assert ids(queue) == ["r2", "r3", "r4"]
    assert queue._queue is deque_before


def test_remove_middle_and_tail() -> None:
    queue, rs = make_queue(6)
    queue.remove([rs[2], rs[5]])
    assert ids(queue) == ["r0", "r1", "r3", "r4"]
    queue.remove([rs[3]])
    assert ids(queue) == ["r0", "r1", "r4"]


def test_remove_head_and_middle_together() -> None:
    queue, rs = make_queue(6)
    queue.remove([rs[0], rs[1], rs[4]])
    assert ids(queue) == ["r2", "r3", "r5"]


def test_remove_everything_and_nothing() -> None:
    queue, rs = make_queue(4)
    queue.remove([])
    assert ids(queue) == ["r0", "r1", "r2", "r3"]
    queue.remove(reversed(rs))
    assert ids(queue) == [] and not queue


def test_remove_is_by_identity_not_by_id() -> None:
    queue, rs = make_queue(3)
    twin = Request("r1", 1.0, 1, 1)  # same id, another object: not in the queue
    queue.remove([twin])
    assert ids(queue) == ["r0", "r1", "r2"]
    queue.remove([rs[1]])
    assert ids(queue) == ["r0", "r2"]


# -- the registry -------------------------------------------------------------------------------
def test_every_registered_order_is_accepted_by_the_config_and_builds_a_queue() -> None:
    assert tuple(QUEUE_ORDERS) == ("fcfs", "priority", "deadline", "aging", "shortest", "fair")
    for name, entry in QUEUE_ORDERS.items():
        assert entry.help and "\n" not in entry.help
        assert SchedulerConfig(queue_order=name).queue_order == name
        queue = orders.make_queue(name, aging_rate=1.0, tenant_weights={})
        assert isinstance(queue, WaitingQueue) and not queue


def test_an_unknown_order_is_refused_with_the_known_names() -> None:
    with pytest.raises(ConfigError, match="queue_order") as info:
        SchedulerConfig(queue_order="lifo")
    assert all(name in str(info.value) for name in QUEUE_ORDERS)
    with pytest.raises(ValueError, match="'lifo'"):
        orders.make_queue("lifo", aging_rate=1.0, tenant_weights={})


def test_only_the_fair_order_charges_service() -> None:
    charging = [n for n in QUEUE_ORDERS if orders.make_queue(n, aging_rate=1.0, tenant_weights={}).charges_service]
    assert charging == ["fair"]


class NewestFirst(WaitingQueue):
    """A toy order for the recipe in docs/extending.md: the newest arrival first."""

    __slots__ = ()

    def candidates(self, now: float) -> Iterator[Request]:
        return reversed(deque(self))


def test_one_registry_entry_adds_an_order_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(QUEUE_ORDERS, "newest", QueueOrder(lambda _: NewestFirst(), "newest arrival first"))
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, queue_order="newest"))
    assert type(s.waiting) is NewestFirst
    for i in range(3):
        s.add_request(Request(f"r{i}", float(i), 1, 1), float(i))
    admitted = []
    for t in range(3):
        out = s.schedule(3.0 + t)
        admitted += [c.request_id for c in out.chunks if c.start == 0]
        s.update(out, StepResult(sampled_token_ids={c.request_id: (0,) for c in out.chunks if c.samples}), 4.0 + t)
    assert admitted == ["r2", "r1", "r0"]
