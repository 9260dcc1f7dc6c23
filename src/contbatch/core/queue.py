"""The waiting queue.

Owns the order in which waiting requests are offered to the scheduler. FCFS by arrival, with
preempted requests put back at the front (they already waited once). Invariant: a request id
appears at most once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from contbatch.core.request import Request


class WaitingQueue:
    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, requests: Iterable[Request]) -> None:
        """Remove `requests` (all present); O(k) when they are at the head, as they usually are."""
        gone = {id(r) for r in requests}
        while gone and self._queue and id(self._queue[0]) in gone:
            gone.discard(id(self._queue.popleft()))
        if gone:
            self._queue = deque(r for r in self._queue if id(r) not in gone)
