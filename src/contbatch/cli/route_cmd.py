"""`contbatch route`: the OpenAI-compatible gateway (`contbatch.gateway`) in front of N backends.

Each ``--backend URL`` (or ``NAME=URL``; repeatable) is any OpenAI-compatible server:
``contbatch serve``, vLLM, SGLang, another gateway. The router (``--router``) is a
`contbatch.routing` spec, the same registry the cluster simulator uses. ``--health-interval``
and ``--scrape-interval`` set how often the backends' ``/health`` and ``/metrics`` are read (the
scrape interval is the simulator's ``signal_delay``); ``--retries`` bounds the other backends
tried when one fails before any byte reached the client. Access flags are the server's
(``--api-key``, ``--api-keys-file``, ``--trust-tenant-header``); ``--upstream-api-key`` (or the
``CONTBATCH_UPSTREAM_API_KEY`` environment variable, kept out of the process list) is sent to
the backends.

Bad flags exit 2 with one line on stderr, as for the other commands.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from contbatch.cli.options import UsageError
from contbatch.cli.serve_cmd import (
    DEFAULT_SEND_BUFFER,
    add_access_flags,
    add_http_flags,
    api_keys,
    check_access_flags,
    run_http,
)
from contbatch.routing import RouterSpecError, make_router, router_help

UPSTREAM_KEY_ENV = "CONTBATCH_UPSTREAM_API_KEY"


def add_route_parser(commands: Any) -> None:
    """Register ``route`` on the subparsers object of the main parser."""
    route = commands.add_parser(
        "route",
        help="run the OpenAI-compatible gateway in front of N backends (routers as in the simulator)",
        description="An OpenAI-compatible gateway in front of N OpenAI-compatible backends: /v1/completions and "
        "/v1/chat/completions (streaming or not) routed by the simulator's routers, /v1/models, /health and its "
        "own /metrics. Backends are health-checked and their /metrics scraped; a backend that fails before any "
        "byte reached the client is retried on another, one that fails after ends the stream with an error event; "
        "a client that disconnects cancels its request on the backend.",
    )
    route.add_argument(
        "--backend",
        dest="backends",
        action="append",
        default=[],
        required=True,
        metavar="[NAME=]URL",
        help="an OpenAI-compatible server, e.g. http://10.0.0.1:8000 (repeatable; NAME labels its metrics, "
        "default host:port)",
    )
    route.add_argument(
        "--router",
        default="least_outstanding",
        metavar="SPEC",
        help="routing policy (default %(default)s): " + router_help().replace("%", "%%"),
    )
    route.add_argument("--host", default="127.0.0.1")
    route.add_argument("--port", type=int, default=8080)
    checks = route.add_argument_group("backends")
    checks.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="GET /health on every backend this often (0: never; default %(default)g)",
    )
    checks.add_argument(
        "--health-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="a health check or scrape not answered by then failed (default %(default)g)",
    )
    checks.add_argument(
        "--unhealthy-after",
        type=int,
        default=1,
        metavar="N",
        help="failed checks in a row that take a backend out of the rotation (default %(default)s)",
    )
    checks.add_argument(
        "--healthy-after",
        type=int,
        default=1,
        metavar="N",
        help="good checks in a row that bring it back (default %(default)s)",
    )
    checks.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="GET /metrics (waiting, running, KV usage) this often: the simulator's signal_delay "
        "(0: never, own in-flight counts only; default %(default)g)",
    )
    checks.add_argument(
        "--retries",
        type=int,
        default=2,
        metavar="N",
        help="other backends tried when one fails before any byte reached the client (default %(default)s)",
    )
    checks.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="to connect to a backend; a timeout is retried elsewhere (default %(default)g)",
    )
    checks.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="a backend silent this long fails the request (default %(default)g)",
    )
    checks.add_argument(
        "--upstream-api-key",
        metavar="KEY",
        help=f"sent to the backends as 'Authorization: Bearer KEY' (or ${UPSTREAM_KEY_ENV}); without "
        "it and without --api-key, the client's Authorization is passed through",
    )
    estimate = route.add_argument_group("routing estimates (the gateway does not tokenize)")
    estimate.add_argument(
        "--chars-per-token",
        type=float,
        default=4.0,
        metavar="C",
        help="prompt tokens = characters / C (default %(default)g)",
    )
    estimate.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="a chat request's output limit when it gives none (default %(default)s)",
    )
    estimate.add_argument(
        "--prefix-block-chars",
        type=int,
        default=64,
        metavar="C",
        help="characters per prefix key, for prefix-aware routers (default %(default)s)",
    )
    access = route.add_argument_group("access (as contbatch serve)")
    add_access_flags(access, limit_concurrency=4096, tenant_upstream=True)
    add_http_flags(access)
    route.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    route.add_argument("--access-log", action="store_true", help="log every HTTP request")


def gateway_config(args: argparse.Namespace) -> Any:
    """The `GatewayConfig` of the flags; `UsageError` for a bad one."""
    from contbatch.gateway.config import GatewayConfig, GatewayConfigError, backends_of

    try:
        make_router(args.router)
    except RouterSpecError as exc:
        raise UsageError(f"--router: {exc}") from None
    check_access_flags(args)
    try:
        config = GatewayConfig(
            backends=backends_of(args.backends),
            router=args.router,
            health_interval_s=args.health_interval,
            health_timeout_s=args.health_timeout,
            unhealthy_after=args.unhealthy_after,
            healthy_after=args.healthy_after,
            scrape_interval_s=args.scrape_interval,
            retries=args.retries,
            connect_timeout_s=args.connect_timeout,
            read_timeout_s=args.timeout,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout or None,
            default_max_tokens=args.default_max_tokens,
            chars_per_token=args.chars_per_token,
            prefix_block_chars=args.prefix_block_chars,
            upstream_api_key=args.upstream_api_key or os.environ.get(UPSTREAM_KEY_ENV) or None,
            api_keys=api_keys(args),
            trust_tenant_header=args.trust_tenant_header,
        )
        return config.check()
    except GatewayConfigError as exc:
        raise UsageError(str(exc)) from None


def build_route_app(args: argparse.Namespace) -> Any:
    """The gateway app the flags describe; `UsageError` for a bad flag."""
    from contbatch.gateway.app import create_gateway_app

    return create_gateway_app(gateway_config(args))


def run_route_command(args: argparse.Namespace) -> int:
    try:
        app = build_route_app(args)
    except UsageError as exc:
        print(f"contbatch route: error: {exc}", file=sys.stderr)
        return 2
    keyed = app.state.gateway.config.api_keys is not None
    return run_http(app, args, command="route", keyed=keyed, send_buffer=DEFAULT_SEND_BUFFER, grace_s=5)
