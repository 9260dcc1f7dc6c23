"""JSON error answers, shared by the server and the gateway: `error_response` turns an `APIError`
into its OpenAI-shaped JSON answer; `add_error_handlers` makes every failure of an app one such
answer (an `APIError` as it is, a 404 / 405 naming the method and path, anything else a logged
500), never an HTML page or a traceback; `ErrorCounter` counts every error answer."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contbatch.server.protocol import APIError

log = logging.getLogger(__name__)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def add_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Register the handlers on `app`; an unexpected exception is logged on `log`."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(APIError(exc.status_code, message, headers=exc.headers))

    async def on_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_error)


class ErrorCounter:
    """ASGI middleware: `count(status)` for every HTTP response started with a status >= 400."""

    def __init__(self, app: ASGIApp, count: Callable[[int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                try:
                    self.count(message["status"])
                except Exception:  # counting must never cost a response
                    log.exception("could not count an HTTP error")
            await send(message)

        await self.app(scope, receive, counting)
