"""The gateway's HTTP app (FastAPI): OpenAI routes in front of N backends.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (routed and relayed,
streaming or not: `contbatch.gateway.proxy`), ``GET /v1/models`` and ``GET /v1/models/{id}``
(the first backend in the rotation that answers), ``GET``/``HEAD /health`` (200 while at least
one backend is in the rotation, else 503) and ``GET /metrics`` (the gateway's own,
`contbatch.gateway.metrics`).

Access is the server's (`contbatch.server.auth.Gate`): with API keys configured, the ``/v1/``
routes answer 401 without a valid key, a key over its quotas gets 429 (its ``max_concurrent``
counts streams until they end), and POST bodies must be ``application/json`` (415). Upstream,
every request carries the gateway's upstream key when one is configured; without one and
without keys of its own, the gateway passes the client's ``Authorization`` through. A request's
tenant (its key's, or a trusted ``X-Tenant``) goes to the backend as ``X-Tenant``: run backends
behind a gateway with ``--trust-tenant-header``. Errors are OpenAI error JSON, as the server's.

The HTTP client to the backends ignores proxy environment variables (``HTTP_PROXY``...): the
backends are addressed as given.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from contbatch.gateway.balancer import Balancer
from contbatch.gateway.config import GatewayConfig
from contbatch.gateway.estimate import route_request
from contbatch.gateway.metrics import GatewayMetrics
from contbatch.gateway.monitor import Monitor
from contbatch.gateway.proxy import Gateway, ProxyCall
from contbatch.routing import WorkPricer
from contbatch.server.auth import Gate, request_tenant
from contbatch.server.errors import ErrorCounter, add_error_handlers
from contbatch.server.protocol import APIError, parse_json_object

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def create_gateway_app(config: GatewayConfig, *, pricer: WorkPricer | None = None) -> FastAPI:
    """The gateway over `config`'s backends; `pricer` prices `least_work` (default: tokens)."""
    gateway = build_gateway(config, pricer=pricer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.monitor.start()
        try:
            yield
        finally:
            await gateway.monitor.stop()
            await gateway.http.aclose()

    app = FastAPI(title="contbatch gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.add_middleware(Gate, keys=config.api_keys)
    app.add_middleware(ErrorCounter, count=gateway.metrics.count_http_error)  # outermost: sees the Gate's too
    add_error_handlers(app, log)
    _add_routes(app, gateway)
    return app


def build_gateway(config: GatewayConfig, *, pricer: WorkPricer | None = None) -> Gateway:
    config.check()
    balancer = Balancer(config.router, [b.name for b in config.backends], pricer=pricer)
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=30.0)
    http = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
    upstream = {"authorization": f"Bearer {config.upstream_api_key}"} if config.upstream_api_key else {}
    monitor = Monitor(config, balancer, http, upstream)
    return Gateway(config, balancer, GatewayMetrics(balancer), monitor, http, upstream)


async def read_body(request: Request, limit: int, timeout_s: float | None) -> bytes:
    """The raw body; 413 beyond `limit` bytes, 408 when not in full within `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s or None):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise _too_large(limit)
                parts.append(part)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive in full within {timeout_s:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None  # fmt: skip
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


def _upstream_headers(gateway: Gateway, request: Request) -> dict[str, str]:
    """What goes upstream besides the gateway's own headers: the client's key when the gateway
    passes it through (no keys of its own, no upstream key)."""
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth is not None and not gateway.owns_auth else {}


async def _generation(gateway: Gateway, request: Request, path: str, *, chat: bool) -> Response:
    config = gateway.config
    raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    body = parse_json_object(raw)  # 400 unless a JSON object
    tenant = request_tenant(request, trust_header=config.trust_tenant_header)
    route = route_request(
        body,
        uuid.uuid4().hex,
        chat=chat,
        tenant=tenant,
        chars_per_token=config.chars_per_token,
        default_max_tokens=config.default_max_tokens,
        prefix_block_chars=config.prefix_block_chars if gateway.balancer.router.needs_prefix else None,
    )
    headers = {"content-type": "application/json", **_upstream_headers(gateway, request)}
    if tenant is not None:
        headers["x-tenant"] = tenant
    return ProxyCall(gateway, path, raw, route, headers, stream=body.get("stream") is True)


async def _first_healthy(gateway: Gateway, request: Request, path: str) -> Response:
    """The answer to a GET of the first backend in the rotation that answers."""
    config = gateway.config
    headers = {**gateway.upstream_headers, **_upstream_headers(gateway, request)}
    for backend in gateway.balancer.healthy:
        try:
            answer = await gateway.http.get(
                gateway.url(backend) + path, headers=headers, timeout=config.connect_timeout_s + config.health_timeout_s
            )
        except (httpx.HTTPError, OSError):
            continue
        media = answer.headers.get("content-type", "application/json")
        return Response(answer.content, status_code=answer.status_code, media_type=media)
    raise APIError(503, "no backend in the rotation answered", code="no_backend", headers={"Retry-After": "1"})


def _health(gateway: Gateway, request: Request) -> Response:
    healthy = len(gateway.balancer.healthy)
    code = 200 if healthy else 503
    if request.method == "HEAD":
        return Response(status_code=code)
    status = "ok" if healthy else "no backend in the rotation"
    return JSONResponse({"status": status, "healthy": healthy, "backends": len(gateway.balancer.backends)},
                        status_code=code)  # fmt: skip


def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await _generation(gateway, request, COMPLETIONS, chat=False)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        return await _generation(gateway, request, CHAT, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _first_healthy(gateway, request, "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await _first_healthy(gateway, request, request.url.path)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        return _health(gateway, request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)
