"""Waiting-queue orders: which waiting request is offered to the scheduler next.

One narrow interface for every order: `push`, `push_front` (a preempted request going back),
`remove`, `__iter__`/`__len__`, and `candidates(now)`, the requests in the order the policy
offers them this step. `admitted` and `charge` let an order learn what the scheduler gave
whom. Chosen by name (`SchedulerConfig.queue_order`):

- `fcfs`: arrival order; preempted requests go back to the front.
- `priority`: lower `priority` value first, ties by arrival.
- `deadline`: earliest deadline first (no deadline: last), ties by arrival.
- `aging`: effective priority = priority - aging_rate x time waited, lowest first. Since every
  request ages at the same rate, this orders by priority + aging_rate x arrival, a key that never
  changes: a request of priority p is overtaken only by requests arriving less than
  (p - p') / aging_rate after it, so none waits unboundedly.
- `fair`: virtual token counters per tenant (VTC, Sheng et al., OSDI 2024): a tenant is charged
  for its prompt tokens at admission and each output token, divided by its weight; the next
  candidate is the head of the backlogged tenant with the smallest counter. A tenant that
  becomes backlogged starts no lower than the smallest counter of the backlogged tenants.

Registry: `QUEUE_ORDERS` maps each name to a `QueueOrder` (a factory taking `QueueOptions`, and a
one-line help). `SchedulerConfig` accepts exactly its names and `make_queue` builds from it, so
adding an order is a class (or a key) here plus one entry, and its test.

Capabilities (class attributes, read by the scheduler instead of testing the queue's type):
- `charges_service`: the order prices output tokens, so the scheduler must call
  `charge(request, num_tokens)` for every output token it grants (True only for `fair`).

Invariant: a request id appears at most once; `candidates` never yields a request twice.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from contbatch.core.request import Request


class WaitingQueue:
    """First come, first served."""

    __slots__ = ("_queue",)

    charges_service: ClassVar[bool] = False  # call `charge` for output tokens (see the module docstring)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def candidates(self, now: float) -> Iterator[Request]:
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

    def admitted(self, request: Request) -> None:
        """The scheduler admitted `request` (still in the queue until `remove`)."""

    def charge(self, request: Request, num_tokens: int) -> None:
        """`request` received `num_tokens` output tokens of service."""


class KeyedQueue(WaitingQueue):
    """Lowest key first; ties by arrival, then by insertion. Keys never change while queued."""

    __slots__ = ("_entries", "_key", "_seq")

    def __init__(self, key: Callable[[Request], float]) -> None:
        super().__init__()
        self._key = key
        self._seq = itertools.count()
        self._entries: list[tuple[float, float, int, Request]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._entries)

    def candidates(self, now: float) -> Iterator[Request]:
        return iter(self)

    def push(self, request: Request) -> None:
        bisect.insort(self._entries, (self._key(request), request.arrival_ts, next(self._seq), request))

    push_front = push  # a preempted request keeps its key, and its early arrival wins ties

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._entries = [e for e in self._entries if id(e[3]) not in gone]


class FairQueue(WaitingQueue):
    """Per-tenant FIFO queues served by smallest virtual token counter."""

    __slots__ = ("_counters", "_queues", "_weights")

    charges_service: ClassVar[bool] = True  # output tokens raise the tenant's counter

    def __init__(self, weights: Mapping[str, float]) -> None:
        super().__init__()
        self._weights = dict(weights)
        self._queues: dict[str | None, deque[Request]] = {}
        self._counters: dict[str | None, float] = {}

    @property
    def counters(self) -> Mapping[str | None, float]:
        return self._counters

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._queues.values())

    def _weight(self, tenant: str | None) -> float:
        return self._weights.get(tenant or "", 1.0)

    def push(self, request: Request) -> None:
        self._enqueue(request).append(request)

    def push_front(self, request: Request) -> None:
        self._enqueue(request).appendleft(request)

    def _enqueue(self, request: Request) -> deque[Request]:
        tenant = request.tenant
        queue = self._queues.setdefault(tenant, deque())
        if not queue:  # becoming backlogged: no credit for time spent idle
            backlogged = [self._counters.get(t, 0.0) for t, q in self._queues.items() if q and t != tenant]
            floor = min(backlogged) if backlogged else 0.0
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), floor)
        return queue

    def remove(self, requests: Iterable[Request]) -> None:
        gone: dict[str | None, set[int]] = {}
        for r in requests:
            gone.setdefault(r.tenant, set()).add(id(r))
        for tenant, ids in gone.items():
            queue = self._queues[tenant]
            self._queues[tenant] = deque(r for r in queue if id(r) not in ids)

    def candidates(self, now: float) -> Iterator[Request]:
        offered = {tenant: 0 for tenant in self._queues}
        while True:
            open_tenants = [t for t, q in self._queues.items() if offered[t] < len(q)]
            if not open_tenants:
                return
            tenant = min(open_tenants, key=lambda t: (self._counters.get(t, 0.0), t or ""))
            offered[tenant] += 1
            yield self._queues[tenant][offered[tenant] - 1]

    def admitted(self, request: Request) -> None:
        if request.num_preemptions == 0:  # recomputing after a preemption is not new service
            self._charge(request.tenant, request.num_prompt_tokens)

    def charge(self, request: Request, num_tokens: int) -> None:
        self._charge(request.tenant, num_tokens)

    def _charge(self, tenant: str | None, num_tokens: int) -> None:
        self._counters[tenant] = self._counters.get(tenant, 0.0) + num_tokens / self._weight(tenant)


@dataclass(frozen=True, slots=True)
class QueueOptions:
    """What a queue order may read from the scheduler config."""

    aging_rate: float = 0.0  # SchedulerConfig.aging_rate
    tenant_weights: Mapping[str, float] = field(default_factory=dict)  # TenantConfig.weight_map


@dataclass(frozen=True, slots=True)
class QueueOrder:
    """One entry of `QUEUE_ORDERS`: how to build the queue, and a line saying what order it keeps."""

    make: Callable[[QueueOptions], WaitingQueue]
    help: str


def _priority(request: Request) -> float:
    return float(request.priority)


def _deadline(request: Request) -> float:
    return request.deadline_ts if request.deadline_ts is not None else float("inf")


def _aging(options: QueueOptions) -> WaitingQueue:
    rate = options.aging_rate
    return KeyedQueue(lambda r: r.priority + rate * r.arrival_ts)


QUEUE_ORDERS: dict[str, QueueOrder] = {
    "fcfs": QueueOrder(lambda _: WaitingQueue(), "arrival order; preempted requests go back to the front"),
    "priority": QueueOrder(lambda _: KeyedQueue(_priority), "lower priority value first, ties by arrival"),
    "deadline": QueueOrder(lambda _: KeyedQueue(_deadline), "earliest deadline first (none: last), ties by arrival"),
    "aging": QueueOrder(_aging, "priority - aging_rate x time waited, lowest first"),
    "fair": QueueOrder(lambda o: FairQueue(o.tenant_weights), "tenant with the smallest virtual token counter first"),
}
"""The queue orders by name: `SchedulerConfig.queue_order` is one of these keys."""


def make_queue(order: str, *, aging_rate: float, tenant_weights: Mapping[str, float]) -> WaitingQueue:
    """A new, empty queue of the order named `order`; ValueError for a name not in `QUEUE_ORDERS`."""
    entry = QUEUE_ORDERS.get(order)
    if entry is None:
        raise ValueError(f"unknown queue order {order!r}; known: {', '.join(QUEUE_ORDERS)}")
    return entry.make(QueueOptions(aging_rate=aging_rate, tenant_weights=tenant_weights))
