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
  becomes backlogged starts no lower than the smallest counter of the backlogged tenants (nor,
  when nobody is backlogged, than the virtual time: the smallest backlogged counter when a tenant
  last stopped being backlogged). Memory and per-step cost follow the backlogged tenants, plus
  the counters of at most `FairQueue.IDLE_MEMORY` recently charged idle tenants; a forgotten
  tenant comes back at the virtual time (see `FairQueue`).

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
import heapq
import itertools
from collections import ChainMap, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from mypy_extensions import mypyc_attr

from contbatch.core.request import Request


@mypyc_attr(allow_interpreted_subclasses=True)  # an extension point (docs/extending.md)
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
        """Remove `requests` (all present); O(k) when they are at the head, as they usually are
        (in order, the cheapest case: identity checks only)."""
        queue = self._queue
        rest = list(requests)
        num_in_order = 0
        for request in rest:
            if not queue or queue[0] is not request:
                break
            queue.popleft()
            num_in_order += 1
        if num_in_order == len(rest):
            return
        gone = set(map(id, rest[num_in_order:]))
        while gone and queue and id(queue[0]) in gone:
            gone.discard(id(queue.popleft()))
        if gone:
            self._queue = deque(r for r in queue if id(r) not in gone)

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

    def push_front(self, request: Request) -> None:
        """A preempted request keeps its key, and its early arrival wins ties."""
        self.push(request)

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._entries = [e for e in self._entries if id(e[3]) not in gone]


@mypyc_attr(allow_interpreted_subclasses=True)  # an extension point (docs/extending.md)
class FairQueue(WaitingQueue):
    """Per-tenant FIFO queues served by smallest virtual token counter (VTC); state for the active
    tenants only.

    What it keeps: the backlogged tenants (a FIFO and a counter each, and a lazy min-heap of their
    counters), the counters of at most `idle_memory` tenants that are not backlogged, least
    recently charged or drained forgotten first (so a tenant's running requests keep being
    charged while it has nothing waiting), and the virtual time `vtime`: the smallest backlogged
    counter when a tenant last stopped being backlogged (never decreasing). A tenant without a
    counter (never seen, or forgotten) counts as being at `vtime`.

    A tenant that becomes backlogged starts at max(its counter, the smallest backlogged counter,
    or `vtime` when nobody is backlogged): no credit for time spent idle, and no lower than any
    backlogged tenant. Costs: `push` and `charge` O(log B) amortized (B backlogged tenants),
    `candidates` a copy of the heap (O(B), at C speed) plus O(log B) per request offered; none
    grows with the number of tenants ever seen."""

    __slots__ = (
        "_backlog",
        "_counters",
        "_heap",
        "_idle",
        "_idle_memory",
        "_order",
        "_seq",
        "_size",
        "_vtime",
        "_weights",
    )

    charges_service: ClassVar[bool] = True  # output tokens raise the tenant's counter
    IDLE_MEMORY: ClassVar[int] = 1024  # counters kept for tenants with nothing waiting

    def __init__(self, weights: Mapping[str, float], *, idle_memory: int = IDLE_MEMORY) -> None:
        super().__init__()
        if idle_memory < 0:
            raise ValueError(f"idle_memory must be >= 0, got {idle_memory}")
        self._weights = dict(weights)
        self._idle_memory = idle_memory
        self._backlog: dict[str | None, deque[Request]] = {}  # backlogged tenants only (non-empty)
        self._counters: dict[str | None, float] = {}  # the backlogged tenants' counters
        self._order: dict[str | None, int] = {}  # a backlogged tenant's episode (heap entries' tie-break)
        self._heap: list[tuple[float, str, int, str | None]] = []  # (counter, name, episode, tenant), lazy
        self._idle: dict[str | None, float] = {}  # not backlogged: least recently touched first
        self._seq = itertools.count()
        self._size = 0
        self._vtime = 0.0

    @property
    def counters(self) -> Mapping[str | None, float]:
        """The counters it keeps: the backlogged tenants' and the remembered idle ones'."""
        return ChainMap(self._counters, self._idle)

    @property
    def vtime(self) -> float:
        return self._vtime

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._backlog.values())

    def _weight(self, tenant: str | None) -> float:
        return self._weights.get(tenant or "", 1.0)

    def push(self, request: Request) -> None:
        self._enqueue(request.tenant).append(request)
        self._size += 1

    def push_front(self, request: Request) -> None:
        self._enqueue(request.tenant).appendleft(request)
        self._size += 1

    def _enqueue(self, tenant: str | None) -> deque[Request]:
        queue = self._backlog.get(tenant)
        if queue is not None:
            return queue
        # becoming backlogged: no credit for time spent idle, no lower than any backlogged tenant
        floor = self._min_backlogged()
        own = self._idle.pop(tenant, self._vtime)
        counter = max(own, self._vtime if floor is None else floor)
        queue = self._backlog[tenant] = deque()
        self._order[tenant] = next(self._seq)
        self._set(tenant, counter)
        return queue

    def remove(self, requests: Iterable[Request]) -> None:
        gone: dict[str | None, set[int]] = {}
        for r in requests:
            gone.setdefault(r.tenant, set()).add(id(r))
        for tenant, ids in gone.items():
            queue = self._backlog.get(tenant)
            if queue is None:
                continue
            before = len(queue)
            while ids and queue and id(queue[0]) in ids:
                ids.discard(id(queue.popleft()))
            if ids:
                queue = self._backlog[tenant] = deque(r for r in queue if id(r) not in ids)
            self._size -= before - len(queue)
            if not queue:
                self._drain(tenant)

    def _drain(self, tenant: str | None) -> None:
        """`tenant` has nothing waiting any more: the virtual time moves up to the smallest
        backlogged counter (its own included), and its counter joins the idle memory."""
        floor = self._min_backlogged()
        if floor is not None and floor > self._vtime:
            self._vtime = floor
        del self._backlog[tenant], self._order[tenant]
        self._remember(tenant, self._counters.pop(tenant))

    def _remember(self, tenant: str | None, counter: float) -> None:
        idle = self._idle
        idle.pop(tenant, None)
        idle[tenant] = counter  # the most recently touched last
        while len(idle) > self._idle_memory:
            del idle[next(iter(idle))]  # forget the least recently touched

    def _set(self, tenant: str | None, counter: float) -> None:
        """A backlogged tenant's counter, with its fresh heap entry."""
        self._counters[tenant] = counter
        heap = self._heap
        heapq.heappush(heap, (counter, tenant or "", self._order[tenant], tenant))
        if len(heap) > 2 * len(self._backlog) + 64:  # drop the stale entries
            self._heap = [(c, t or "", self._order[t], t) for t, c in self._counters.items()]
            heapq.heapify(self._heap)

    def _fresh(self, entry: tuple[float, str, int, str | None]) -> bool:
        counter, _, episode, tenant = entry
        return self._order.get(tenant) == episode and self._counters[tenant] == counter

    def _min_backlogged(self) -> float | None:
        heap = self._heap
        while heap and not self._fresh(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def candidates(self, now: float) -> Iterator[Request]:
        # every backlogged tenant has a fresh entry in the copy; counters only rise while a tenant
        # is backlogged, so an entry's key is at most its tenant's counter, and an entry popped
        # with a key below it is pushed back with the counter (lazy re-keying)
        heap = list(self._heap)  # a copy: the queue's heap stays intact if iteration stops early
        offered: dict[str | None, int] = {}
        while heap:
            key, name, episode, tenant = heap[0]
            queue = self._backlog.get(tenant)
            if queue is None or self._order[tenant] != episode:
                heapq.heappop(heap)  # no longer backlogged (or an earlier episode)
                continue
            counter = self._counters[tenant]
            if key != counter:
                heapq.heapreplace(heap, (counter, name, episode, tenant))
                continue
            n = offered.get(tenant, 0)
            if n >= len(queue):
                heapq.heappop(heap)  # every request of this tenant was offered
                continue
            offered[tenant] = n + 1
            yield queue[n]
            heapq.heapreplace(heap, (self._counters.get(tenant, key), name, episode, tenant))

    def admitted(self, request: Request) -> None:
        if request.num_preemptions == 0:  # recomputing after a preemption is not new service
            self._charge(request.tenant, request.num_prompt_tokens)

    def charge(self, request: Request, num_tokens: int) -> None:
        self._charge(request.tenant, num_tokens)

    def _charge(self, tenant: str | None, num_tokens: int) -> None:
        cost = num_tokens / self._weight(tenant)
        if tenant in self._counters:
            self._set(tenant, self._counters[tenant] + cost)
        else:
            self._remember(tenant, self._idle.get(tenant, self._vtime) + cost)


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


def _aged(base: Callable[[Request], float]) -> Callable[[QueueOptions], WaitingQueue]:
    """A keyed order whose key is base(request) + aging_rate x arrival: lowering the key by
    aging_rate per time unit waited, the same for every request, is this fixed key."""

    def make(options: QueueOptions) -> WaitingQueue:
        rate = options.aging_rate
        return KeyedQueue(lambda r: base(r) + rate * r.arrival_ts)

    return make


def _prompt_tokens(request: Request) -> float:
    return float(request.num_prompt_tokens)


QUEUE_ORDERS: dict[str, QueueOrder] = {
    "fcfs": QueueOrder(lambda _: WaitingQueue(), "arrival order; preempted requests go back to the front"),
    "priority": QueueOrder(lambda _: KeyedQueue(_priority), "lower priority value first, ties by arrival"),
    "deadline": QueueOrder(lambda _: KeyedQueue(_deadline), "earliest deadline first (none: last), ties by arrival"),
    "aging": QueueOrder(_aged(_priority), "priority - aging_rate x time waited, lowest first"),
    "shortest": QueueOrder(_aged(_prompt_tokens), "fewest prompt tokens first, less aging_rate tokens per time waited"),
    "fair": QueueOrder(lambda o: FairQueue(o.tenant_weights), "tenant with the smallest virtual token counter first"),
}
"""The queue orders by name: `SchedulerConfig.queue_order` is one of these keys."""


def make_queue(order: str, *, aging_rate: float, tenant_weights: Mapping[str, float]) -> WaitingQueue:
    """A new, empty queue of the order named `order`; ValueError for a name not in `QUEUE_ORDERS`."""
    entry = QUEUE_ORDERS.get(order)
    if entry is None:
        raise ValueError(f"unknown queue order {order!r}; known: {', '.join(QUEUE_ORDERS)}")
    return entry.make(QueueOptions(aging_rate=aging_rate, tenant_weights=tenant_weights))
