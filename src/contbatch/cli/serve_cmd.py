"""`contbatch serve`: the OpenAI-compatible server (`contbatch.server`) on a host and port.

``--backend sim`` paces the simulator's cost model (``--cost affine[:k=v,...]``, seconds) in
real time; ``--backend engine`` runs the real engine on the checkpoint directory ``--model``.
The scheduler config is ``--preset`` (default ``engine``) plus ``--set KEY=VALUE`` overrides,
mapped exactly as for ``simulate`` (`contbatch.cli.options`). On top of the preset the server
sets its own defaults, which ``--set`` overrides: ``lifecycle.output_credits=256`` (a client
that stops reading pauses its request instead of having its output buffered without bound) and
``lifecycle.max_waiting=1024`` (a full queue answers 429).

Bad flags exit 2 with one line on stderr, as for the other commands.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from contbatch.cli.options import UsageError, cost_model, scheduler_config
from contbatch.core import SCHEDULERS
from contbatch.core.config import PRESETS
from contbatch.sim.cost import cost_help

SERVER_DEFAULTS: tuple[str, ...] = ("lifecycle.output_credits=256", "lifecycle.max_waiting=1024")


def add_serve_parser(commands: Any) -> None:
    """Register ``serve`` on the subparsers object of the main parser."""
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible server (sim or engine backend)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    serve.add_argument("--backend", default="sim", help="sim (the cost model paced in real time) or engine")
    serve.add_argument(
        "--cost",
        default="affine",
        help=f"sim backend: cost model in seconds, one of: {cost_help('s')}".replace("%", "%%"),
    )
    serve.add_argument("--model", help="engine: a local checkpoint directory; sim: the model name served")
    serve.add_argument(
        "--kv-cache-memory", type=float, default=None, metavar="MIB", help="engine: KV cache size in MiB (default 256)"
    )
    serve.add_argument("--served-model-name", help="the model id clients name (default: --model, or contbatch-sim)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--scheduler", default="continuous", help=f"one of {', '.join(SCHEDULERS)}")
    serve.add_argument("--preset", choices=sorted(PRESETS), default="engine", help="scheduler semantics (engine)")
    serve.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scheduler config field, as for simulate: max_num_seqs=64, kv.num_blocks=2048, "
        "lifecycle.request_timeout=60, lifecycle.ttft_timeout=10, lifecycle.max_waiting=256, ...",
    )
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    serve.add_argument("--default-max-tokens", type=int, default=1024, help="chat requests that give no limit")
    serve.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S", help="in-flight time at shutdown")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.add_argument(
        "--access-log", action="store_true", help="log every HTTP request (off: it costs CPU under load)"
    )


def build_app(args: argparse.Namespace) -> Any:
    """The FastAPI app the flags describe; `UsageError` for a bad flag."""
    from contbatch.server.app import create_app
    from contbatch.server.backends import BackendError, BackendOptions, make_backend
    from contbatch.server.client import DriverClient
    from contbatch.server.serving import ServerConfig
    from contbatch.sim.cost import AffineCost

    if args.scheduler not in SCHEDULERS:
        raise UsageError(f"--scheduler: unknown {args.scheduler!r}; known: {', '.join(SCHEDULERS)}")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--default-max-tokens", args.default_max_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.shutdown_grace < 0:
        raise UsageError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        raise UsageError(f"--kv-cache-memory must be > 0 MiB, got {args.kv_cache_memory}")
    cost = cost_model(args.cost) if args.backend == "sim" else None
    overrides = [*SERVER_DEFAULTS, *args.overrides]
    config = scheduler_config(args.preset, cost if cost is not None else AffineCost(), overrides)
    try:
        kv_bytes = int(args.kv_cache_memory * 1024**2) if args.kv_cache_memory is not None else None
        options = BackendOptions(cost, args.model, args.served_model_name, kv_bytes)
        backend = make_backend(args.backend, config, options)
    except BackendError as exc:
        raise UsageError(f"--backend {args.backend}: {exc}") from None
    server_config = ServerConfig(
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        shutdown_grace_s=args.shutdown_grace,
    )
    return create_app(DriverClient(backend, scheduler=args.scheduler), server_config)


def run_serve_command(args: argparse.Namespace) -> int:
    try:
        app = build_app(args)
    except UsageError as exc:
        print(f"contbatch serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=max(1, round(args.shutdown_grace)),
    )
    return 0
