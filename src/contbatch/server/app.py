"""The OpenAI-compatible HTTP server (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (`contbatch.server.serving`),
``GET /v1/models``, ``GET /v1/models/{id}`` (its card, or 404 ``model_not_found``),
``GET``/``HEAD /health`` (200 while the step driver runs, 503 otherwise) and
``GET /metrics`` (Prometheus text, `contbatch.server.metrics`).

Every error, including unknown routes, wrong methods and failures of our own, is answered with
the OpenAI error JSON; nothing a client sends can stop the process. The app starts its
`EngineClient` on startup and shuts it down gracefully (in-flight requests get
`ServerConfig.shutdown_grace_s`, then are cancelled) on shutdown.

Before any route, the `contbatch.server.auth.Gate` answers 401 (API keys, on the ``/v1/``
routes), 415 (a POST body not declared ``application/json``) and 429 (a key over its quotas);
long prompts are tokenized on a bounded pool (`contbatch.server.admission`). Every response
sent with an error status, the Gate's and routing's included, is counted
(``http_request_errors_total{status}``, `contbatch.server.metrics`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from contbatch.server.admission import TokenizerPool
from contbatch.server.auth import Gate
from contbatch.server.client import EngineClient
from contbatch.server.errors import ErrorCounter, add_error_handlers, error_response
from contbatch.server.protocol import APIError
from contbatch.server.serving import ServerConfig, generate

log = logging.getLogger(__name__)


def create_app(client: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        yield
        await asyncio.to_thread(client.shutdown, config.shutdown_grace_s)
        pool.close()

    app = FastAPI(title="contbatch", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.client = client
    app.state.config = config
    pool = app.state.tokenizer_pool = TokenizerPool(
        config.tokenizer_workers, config.tokenizer_queue, retry_after_s=config.retry_after_s
    )
    app.add_middleware(Gate, keys=config.api_keys)  # 401 (API keys), 415 (not JSON), 429 (key quotas)
    app.add_middleware(ErrorCounter, count=client.count_http_error)  # outermost: sees the Gate's answers too
    add_error_handlers(app, log)
    _add_routes(app, client)
    return app


def _add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _guarded(generate(request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _guarded(generate(request, chat=True))

    def model_card() -> dict[str, object]:
        info = client.model
        return {
            "id": info.name,
            "object": "model",
            "created": info.created,
            "owned_by": "contbatch",
            "root": info.name,
            "parent": None,
            "max_model_len": info.max_model_len,
            "backend": info.backend,
        }

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        name = client.model.name
        if model_id != name:
            message = f"the model '{model_id}' does not exist; this server serves '{name}'"
            return error_response(APIError(404, message, param="model", code="model_not_found"))
        return JSONResponse(model_card())

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        status = client.health()
        code = 200 if status.ok else 503
        if request.method == "HEAD":
            return Response(status_code=code)
        return JSONResponse({"status": "ok" if status.ok else status.detail}, status_code=code)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.render_metrics(), media_type=CONTENT_TYPE_LATEST)


async def _guarded(call: object) -> Response:
    """Await a handler; an `APIError` becomes its JSON answer, anything else a 500 (logged)."""
    assert asyncio.iscoroutine(call)
    try:
        response: Response = await call
    except APIError as exc:
        return error_response(exc)
    except Exception as exc:
        log.exception("request failed")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))
    return response
