"""`Balancer`: the gateway's routing state, over the routing core the cluster simulator uses.

One router (`contbatch.routing.make_router`, the same registry and classes as the simulator's),
one `LoadTracker` (the gateway's own accounting), and each backend's health. A decision is
`router.choose(request, views)` over the views of the backends in the rotation, in the order
they were configured, exactly as the simulator's `Group.route` calls it over its routable
replicas: fed the same tracker calls and the same scrapes, the gateway and the simulator choose
the same backend (`tests/gateway/test_gateway_decisions.py` replays a simulation into it).

What feeds it, and when (`contbatch.gateway.proxy`, `contbatch.gateway.monitor`):

- `route` when a request is sent to a backend (`LoadTracker.routed`), `first_token` when the
  first chunk with output arrives, `tokens` for the output tokens of each later chunk,
  `finished` when the answer ends, however it ends (a failed attempt too, before a retry);
- `scraped` with each backend's `/metrics` (a `Scrape`, or None when the backend exports none of
  the load gauges: routers then fall back on the gateway's own counts, as `ReplicaView` does);
- `set_healthy` from the health checks (and a connection failure): a backend out of the rotation
  keeps its accounting (its requests in flight still end) but is offered to no router.

No asyncio and no I/O: it is driven from the event loop, one call at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from contbatch.routing import LoadTracker, ReplicaView, Router, RouteRequest, Scrape, WorkPricer, make_router


class Balancer:
    def __init__(self, router: str | Router, backends: Sequence[str], *, pricer: WorkPricer | None = None) -> None:
        self.router = make_router(router, pricer=pricer) if isinstance(router, str) else router
        self.tracker = LoadTracker()
        self.backends = tuple(backends)
        self._healthy = dict.fromkeys(self.backends, True)
        for backend in self.backends:
            self.tracker.add_replica(backend)

    # -- the rotation ---------------------------------------------------------------------------
    def is_healthy(self, backend: str) -> bool:
        return self._healthy[backend]

    def set_healthy(self, backend: str, healthy: bool) -> bool:
        """Put `backend` in (or take it out of) the rotation; whether that changed anything."""
        changed = self._healthy[backend] != healthy
        self._healthy[backend] = healthy
        return changed

    @property
    def healthy(self) -> list[str]:
        return [b for b in self.backends if self._healthy[b]]

    def views(self, exclude: Collection[str] = ()) -> list[ReplicaView]:
        """The views a router decides on: the backends in the rotation, less `exclude`, in order."""
        return [v for v in self.tracker.views() if self._healthy[v.replica_id] and v.replica_id not in exclude]

    # -- decisions and accounting ---------------------------------------------------------------
    def choose(self, request: RouteRequest, exclude: Collection[str] = ()) -> str | None:
        """The backend the router picks for `request` (None when none is in the rotation)."""
        views = self.views(exclude)
        if not views:
            return None
        return views[self.router.choose(request, views)].replica_id

    def route(self, request: RouteRequest, exclude: Collection[str] = ()) -> str | None:
        """`choose`, then count the request there (`LoadTracker.routed`)."""
        backend = self.choose(request, exclude)
        if backend is not None:
            self.tracker.routed(request, backend)
        return backend

    def first_token(self, request_id: str) -> None:
        self.tracker.first_token(request_id)

    def tokens(self, request_id: str, num_tokens: int) -> None:
        self.tracker.tokens(request_id, num_tokens)

    def finished(self, request_id: str) -> str | None:
        return self.tracker.finished(request_id)

    def scraped(self, backend: str, scrape: Scrape | None) -> None:
        self.tracker.scraped(backend, scrape)

    def in_flight(self, backend: str) -> int:
        return self.tracker.view(backend).num_in_flight
