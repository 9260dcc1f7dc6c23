"""contbatch.routing: the routing core shared by the cluster simulator and a real gateway.

A router (`routers`, built by name from `registry.make_router`) chooses a replica for a request
(`view.RouteRequest`) from one `view.ReplicaView` per routable replica: what a gateway can know
(its own in-flight accounting, kept by `tracker.LoadTracker`, and the replicas' `/metrics`
scrapes, possibly delayed). Equal inputs give equal decisions, in any process: hashing is stable
(`hashing`), ties go to the lowest index.

Layering: the standard library only (no contbatch.core, no numpy, no asyncio): a gateway imports
it without the simulator, and the simulator passes in what needs a cost model (`WorkPricer`).
"""

from contbatch.routing.hashing import chain, mix64, text_block_keys, text_hash, token_block_keys
from contbatch.routing.registry import ROUTERS, SCORERS, RouterSpecError, make_router, parse_router_spec, router_help
from contbatch.routing.routers import (
    LeastKV,
    LeastOutstanding,
    LeastWork,
    NoReplica,
    PrefixAffinity,
    PrefixIndex,
    RoundRobin,
    Router,
    Scorer,
    Weighted,
    WorkPricer,
    count_tokens,
    routing_key,
)
from contbatch.routing.tracker import LoadTracker
from contbatch.routing.view import ReplicaView, RouteRequest, Scrape

__all__ = [
    "ROUTERS",
    "SCORERS",
    "LeastKV",
    "LeastOutstanding",
    "LeastWork",
    "LoadTracker",
    "NoReplica",
    "PrefixAffinity",
    "PrefixIndex",
    "ReplicaView",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "RouterSpecError",
    "Scorer",
    "Scrape",
    "Weighted",
    "WorkPricer",
    "chain",
    "count_tokens",
    "make_router",
    "mix64",
    "parse_router_spec",
    "router_help",
    "routing_key",
    "text_block_keys",
    "text_hash",
    "token_block_keys",
]
