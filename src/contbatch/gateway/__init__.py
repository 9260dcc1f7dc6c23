"""contbatch.gateway: `contbatch route`, an OpenAI-compatible gateway in front of N backends.

It routes with the routing core the cluster simulator uses (`contbatch.routing`: the same
router classes from the same registry, fed the same `LoadTracker` calls), so that the gateway
and the simulator take the same decision given the same observed state.

Modules: `config` (backends and limits), `balancer` (the router, the tracker and each backend's
health: no I/O), `estimate` (a `RouteRequest` from a request body), `monitor` (health checks and
`/metrics` scrapes, `scrape` parses them), `proxy` (one request: forward, relay, retry before the
first byte, a clean SSE error after it, cancellation on disconnect), `metrics` (its own
Prometheus metrics) and `app` (the routes, behind the server's API-key gate).

Layering: it imports the routing core and the server's access and error helpers
(`contbatch.server.auth`, `.protocol`, `.formats`), never torch, `contbatch.engine` or
`contbatch.sim` (`tests/test_layering.py`). Nothing in it assumes one host: scaling out is more
backends, anywhere the gateway can reach.
"""

from contbatch.gateway.balancer import Balancer
from contbatch.gateway.config import BackendSpec, GatewayConfig, GatewayConfigError, parse_backend

__all__ = ["BackendSpec", "Balancer", "GatewayConfig", "GatewayConfigError", "parse_backend"]
