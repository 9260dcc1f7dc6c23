"""WaitingQueue: FCFS order, push_front, and `remove` (head fast path and the general case)."""

from __future__ import annotations

from contbatch.core.queue import WaitingQueue
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
