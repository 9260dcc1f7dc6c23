"""The routers: given the request and one `ReplicaView` per routable replica, the index of the
replica to send it to.

- `round_robin`: each in turn (its own counter: every pool has its own router, so a prefill
  pool and a decode pool never share one);
- `least_outstanding`: the fewest requests in flight (the gateway's own count);
- `least_kv`: the lowest scraped KV usage, then the fewest in flight;
- `least_work`: the least priced work: the prompt tokens waiting for a first token (this
  request's included) plus the output tokens decoding requests may still produce, priced by a
  `WorkPricer` (the simulator's prices them with each replica's cost model, so a slower device
  counts more seconds for the same tokens; the default counts tokens);
- `prefix_affinity`: consistent hashing of the prompt's leading blocks on a ring of virtual
  nodes, with bounded load (Mirrokni et al.): the first replica clockwise whose in-flight count
  stays within `load` times the mean takes it, so a hot prefix spills over instead of piling up;
- `weighted`: a weighted sum of scorers in [0, 1] (`prefix`: the share of the prompt's blocks
  this gateway last sent there, an approximate prefix cache as llm-d's scorer keeps; `queue`,
  `kv`, `load`, `work`), the highest total wins.

Determinism: `choose` is a pure function of the request, the views (values and order) and the
router's own state (the round-robin counter, the prefix index), and every tie goes to the
lowest index. Equal inputs give equal decisions in any process (hashes are `routing.hashing`'s).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from contbatch.routing.hashing import mix64, text_hash
from contbatch.routing.view import ReplicaView, RouteRequest

# (replica id, prefill tokens, decode tokens, decoding requests) -> seconds (or any unit) of work
WorkPricer = Callable[[str, int, int, int], float]


def count_tokens(replica_id: str, prefill_tokens: int, decode_tokens: int, num_decoding: int) -> float:
    """The default `WorkPricer`: one unit per token, whatever the replica."""
    return float(prefill_tokens + decode_tokens)


class NoReplica(ValueError):
    """There is no replica to route to."""


class Router:
    """Base class: subclasses implement `_choose`. What a router reads, so that callers may skip
    feeding the rest: `needs_prefix` (`RouteRequest.prefix_keys`), `needs_scrape`
    (`ReplicaView.scrape`), `needs_tokens` (first tokens and streamed tokens in the tracker)."""

    name = "router"
    needs_prefix = False
    needs_scrape = False
    needs_tokens = False

    def choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        """The index in `views` of the replica `request` goes to (NoReplica when `views` is empty)."""
        if not views:
            raise NoReplica(f"no replica to route {request.request_id!r} to")
        return self._choose(request, views)

    def _choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        raise NotImplementedError


def _argmin(keys: Sequence[tuple[float, ...]]) -> int:
    return min(range(len(keys)), key=keys.__getitem__)


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def _choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        index = self._turn % len(views)
        self._turn += 1
        return index


class LeastOutstanding(Router):
    name = "least_outstanding"

    def _choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        best, best_load = 0, views[0].num_in_flight
        for i in range(1, len(views)):
            load = views[i].num_in_flight
            if load < best_load:
                best, best_load = i, load
        return best


class LeastKV(Router):
    name = "least_kv"
    needs_scrape = True

    def _choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        return _argmin([(v.kv_usage or 0.0, v.num_in_flight) for v in views])


class LeastWork(Router):
    name = "least_work"
    needs_tokens = True

    def __init__(self, pricer: WorkPricer = count_tokens) -> None:
        self.pricer = pricer

    def work(self, request: RouteRequest, view: ReplicaView) -> float:
        prefill = view.pending_prompt_tokens + request.num_prompt_tokens
        return self.pricer(view.replica_id, prefill, view.decode_tokens, view.num_decoding)

    def _choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        return _argmin([(self.work(request, v),) for v in views])


def routing_key(request: RouteRequest, num_blocks: int) -> int:
    """The key `prefix_affinity` places a request by: its chained key after `num_blocks` blocks
    (its last one when shorter), or a hash of its id when it has no full block."""
    keys = request.prefix_keys
    if keys:
        return keys[min(num_blocks, len(keys)) - 1]
    return text_hash(request.request_id)


class PrefixAffinity(Router):
    name = "prefix_affinity"
    needs_prefix = True

    def __init__(self, load: float = 1.25, vnodes: int = 64, blocks: int = 8) -> None:
        if not load >= 1.0 or vnodes < 1 or blocks < 1:
            got = f"load={load}, vnodes={vnodes}, blocks={blocks}"
            raise ValueError(f"prefix_affinity needs load >= 1, vnodes >= 1 and blocks >= 1; got {got}")
        self.load, self.vnodes, self.blocks = load, vnodes, blocks
        self._ring_ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, ids: tuple[str, ...]) -> None:
        if ids == self._ring_ids:
            return
        nodes = sorted((mix64(text_hash(f"{rid}#{v}")), rid) for rid in ids for v in range(self.vnodes))
        self._ring_ids, self._points, self._owners = ids, [p for p, _ in nodes], [r for _, r in nodes]

    def capacity(self, views: Sequence[ReplicaView]) -> int:
        """The most requests in flight a replica may hold and still take one more."""
        total = sum(v.num_in_flight for v in views) + 1
        return math.ceil(self.load * total / len(views))

    def _choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        self._ring(tuple(v.replica_id for v in views))
        index_of = {v.replica_id: i for i, v in enumerate(views)}
        cap = self.capacity(views)
        start = bisect.bisect_left(self._points, routing_key(request, self.blocks))
        owners, n = self._owners, len(self._owners)
        for step in range(n):
            i = index_of[owners[(start + step) % n]]
            if views[i].num_in_flight < cap:
                return i
        return LeastOutstanding()._choose(request, views)  # (unreachable: the mean is below the bound)


# -- weighted scorers ------------------------------------------------------------------------------
class PrefixIndex:
    """Per replica, the prefix keys this gateway last sent there (an LRU of `capacity` keys): an
    approximation of each replica's prefix cache from the gateway's own routing."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._keys: dict[str, OrderedDict[int, None]] = {}

    def match(self, replica_id: str, keys: Sequence[int]) -> int:
        """How many leading `keys` were sent to `replica_id` (and are still remembered)."""
        known = self._keys.get(replica_id)
        if not known:
            return 0
        count = 0
        for key in keys:
            if key not in known:
                break
            count += 1
        return count

    def record(self, replica_id: str, keys: Sequence[int]) -> None:
        known = self._keys.setdefault(replica_id, OrderedDict())
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > self.capacity:
            known.popitem(last=False)


def _spread(values: Sequence[float]) -> list[float]:
    """1 for the lowest value, 0 for the highest, linear between (all 1 when equal)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


class Scorer:
    name = "scorer"
    needs_prefix = needs_scrape = needs_tokens = False

    def scores(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[float]:
        raise NotImplementedError

    def chosen(self, request: RouteRequest, view: ReplicaView) -> None:
        """The router sent `request` to `view`'s replica."""


class PrefixScorer(Scorer):
    name = "prefix"
    needs_prefix = True

    def __init__(self, index: PrefixIndex | None = None) -> None:
        self.index = index or PrefixIndex()

    def scores(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[float]:
        keys = request.prefix_keys
        if not keys:
            return [0.0] * len(views)
        return [self.index.match(v.replica_id, keys) / len(keys) for v in views]

    def chosen(self, request: RouteRequest, view: ReplicaView) -> None:
        self.index.record(view.replica_id, request.prefix_keys)


class QueueScorer(Scorer):
    name = "queue"
    needs_scrape = True

    def scores(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[float]:
        return _spread([float(v.num_waiting) for v in views])


class KVScorer(Scorer):
    name = "kv"
    needs_scrape = True

    def scores(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[float]:
        return [1.0 - (v.kv_usage or 0.0) for v in views]


class LoadScorer(Scorer):
    name = "load"

    def scores(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[float]:
        return _spread([float(v.num_in_flight) for v in views])


class WorkScorer(Scorer):
    name = "work"
    needs_tokens = True

    def __init__(self, pricer: WorkPricer = count_tokens) -> None:
        self._work = LeastWork(pricer)

    def scores(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[float]:
        return _spread([self._work.work(request, v) for v in views])


class Weighted(Router):
    name = "weighted"

    def __init__(self, parts: Sequence[tuple[float, Scorer]]) -> None:
        if not parts or any(not w > 0 for w, _ in parts):
            raise ValueError("weighted needs at least one scorer, each with a weight > 0")
        self.parts = tuple(parts)
        self.needs_prefix = any(s.needs_prefix for _, s in parts)
        self.needs_scrape = any(s.needs_scrape for _, s in parts)
        self.needs_tokens = any(s.needs_tokens for _, s in parts)

    def totals(self, request: RouteRequest, views: Sequence[ReplicaView]) -> list[float]:
        totals = [0.0] * len(views)
        for weight, scorer in self.parts:
            for i, score in enumerate(scorer.scores(request, views)):
                totals[i] += weight * score
        return totals

    def _choose(self, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
        totals = self.totals(request, views)
        best = max(range(len(totals)), key=lambda i: (totals[i], -i))
        for _, scorer in self.parts:
            scorer.chosen(request, views[best])
        return best
