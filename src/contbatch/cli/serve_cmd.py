"""`contbatch serve`: the OpenAI-compatible server (`contbatch.server`) on a host and port.

``--backend sim`` paces the simulator's cost model (``--cost affine[:k=v,...]``, seconds) in
real time; ``--backend engine`` runs the real engine on the checkpoint directory ``--model``.
The scheduler config is ``--preset`` (default ``engine``) plus ``--set KEY=VALUE`` overrides,
mapped exactly as for ``simulate`` (`contbatch.cli.options`). On top of the preset the server
sets its own defaults, which ``--set`` overrides: ``lifecycle.output_credits=256`` (a client
that stops reading pauses its request instead of having its output buffered without bound),
``lifecycle.max_pause=2`` (a request paused that long gives up its seat and KV memory, by
preemption, as soon as another request waits for them: a client that never reads cannot hold a
seat) and ``lifecycle.max_waiting=1024`` (a full queue answers 429). A client that stops reading
is noticed once what the server wrote is stuck in the connection's buffers: ``--send-buffer``
(64 KiB) caps the kernel's send buffer of each connection, and asyncio's at a quarter of it
(without it Linux grows it to 4 MB, some 17,000 streamed tokens, before the request even pauses).

Admission and access (`contbatch.server.admission`, `contbatch.server.auth`): ``--api-key`` and
``--api-keys-file`` require a key on the ``/v1/`` routes and map each key to a tenant, a priority
and quotas; ``--trust-tenant-header`` honours ``X-Tenant``; ``--body-timeout`` (30 s) answers 408
to a body that has not arrived by then and ``--header-timeout`` (20 s) closes a connection whose
request head has not (`contbatch.server.connections`); ``--limit-concurrency`` (2048) caps open
connections (uvicorn answers 503 beyond it); ``--tokenizer-workers`` (2) and ``--tokenizer-queue`` (64) bound
the tokenization of long prompts (503 beyond).

Before it serves, the process freezes its start-up heap (`contbatch.collector.freeze_startup_heap`).

Bad flags exit 2 with one line on stderr, as for the other commands.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from contbatch.cli.options import UsageError, cost_model, scheduler_config
from contbatch.collector import freeze_startup_heap
from contbatch.core import SCHEDULERS
from contbatch.core.config import PRESETS
from contbatch.sim.cost import cost_help

if TYPE_CHECKING:
    from contbatch.server.connections import Activity

SERVER_DEFAULTS: tuple[str, ...] = (
    "lifecycle.output_credits=256",
    "lifecycle.max_pause=2",
    "lifecycle.max_waiting=1024",
)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_SEND_BUFFER = 64 << 10  # bytes; see the module docstring
# the names of `contbatch.server.connections` (AUTO and PARSERS; named here: building the parser
# must not import uvicorn) and uvicorn's event loops; auto: the C one when it is installed
HTTP_PARSERS = ("auto", "h11", "httptools")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def add_http_flags(parser: Any) -> None:
    """``--http`` (the request parser) and ``--loop`` (the event loop), for `serve` and `route`."""
    parser.add_argument(
        "--http",
        choices=HTTP_PARSERS,
        default="auto",
        help="HTTP request parser: httptools (C) when it is installed, else h11 (default %(default)s)",
    )
    parser.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="event loop: uvloop when it is installed, else asyncio's (default %(default)s)",
    )


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
    serve.add_argument("--device", help="engine: cpu or cuda (default: cuda when present)")
    serve.add_argument("--dtype", help="engine: float32 (CPU default), float16 or bfloat16")
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
    serve.add_argument("--default-max-tokens", type=int, default=1024, help="chat requests that give no limit")
    serve.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S", help="in-flight time at shutdown")
    serve.add_argument(
        "--gather-gap",
        type=float,
        default=0.0,
        metavar="S",
        help="an idle engine's first step waits for a burst: until no request arrived for S seconds "
        "(0, the default: it starts at once)",
    )
    serve.add_argument(
        "--gather-max", type=float, default=0.25, metavar="S", help="... and at most S seconds in all (default 0.25)"
    )
    add_access_flags(serve, limit_concurrency=2048)
    serve.add_argument(
        "--send-buffer",
        type=int,
        default=DEFAULT_SEND_BUFFER,
        metavar="BYTES",
        help="kernel send buffer of each connection (0: the OS's autotuning, megabytes; default %(default)s)",
    )
    serve.add_argument(
        "--tokenizer-workers",
        type=int,
        default=2,
        metavar="N",
        help="threads tokenizing long prompts, and short ones while half their places are free (default %(default)s)",
    )
    serve.add_argument(
        "--tokenizer-queue",
        type=int,
        default=64,
        metavar="N",
        help="prompts admitted to them at once (a long prompt beyond: 503; default %(default)s)",
    )
    add_http_flags(serve)
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.add_argument(
        "--access-log", action="store_true", help="log every HTTP request (off: it costs CPU under load)"
    )


def add_access_flags(parser: Any, *, limit_concurrency: int, tenant_upstream: bool = False) -> None:
    """The flags `serve` and `route` share (checked by `check_access_flags`): API keys and tenants,
    the request body's size and time, the request head's time, open connections at most."""
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY) on the /v1/ routes; repeatable",
    )
    upstream = "; the tenant goes upstream as X-Tenant" if tenant_upstream else ""
    parser.add_argument(
        "--api-keys-file",
        metavar="PATH",
        help=f"JSON or YAML: key -> {{tenant, priority, max_concurrent, rate, burst}} (see docs/server.md){upstream}",
    )
    parser.add_argument(
        "--trust-tenant-header",
        action="store_true",
        help="honour a client's X-Tenant (else a request's tenant is its API key's, or none)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a request body not in by then: 408 (0: none; default %(default)g)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="close a connection whose request head is not in by then (slow loris; 0: none; default %(default)g)",
    )
    parser.add_argument(
        "--limit-concurrency",
        type=int,
        default=limit_concurrency,
        metavar="N",
        help="open client connections at most (0: no limit; default %(default)s)",
    )


def check_access_flags(args: argparse.Namespace) -> None:
    """UsageError for a bad value of `add_access_flags`' flags."""
    if args.max_body_bytes < 1:
        raise UsageError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    for flag, number in (
        ("--body-timeout", args.body_timeout),
        ("--header-timeout", args.header_timeout),
        ("--limit-concurrency", args.limit_concurrency),
    ):
        if not number >= 0:
            raise UsageError(f"{flag} must be >= 0, got {number}")


def _check_flags(args: argparse.Namespace) -> None:
    if args.scheduler not in SCHEDULERS:
        raise UsageError(f"--scheduler: unknown {args.scheduler!r}; known: {', '.join(SCHEDULERS)}")
    check_access_flags(args)
    positive = (
        ("--default-max-tokens", args.default_max_tokens),
        ("--tokenizer-workers", args.tokenizer_workers),
        ("--tokenizer-queue", args.tokenizer_queue),
    )
    for flag, value in positive:
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    for flag, number in (
        ("--shutdown-grace", args.shutdown_grace),
        ("--send-buffer", args.send_buffer),
    ):
        if not number >= 0:
            raise UsageError(f"{flag} must be >= 0, got {number}")
    for flag, seconds in (("--gather-gap", args.gather_gap), ("--gather-max", args.gather_max)):
        if not 0 <= seconds < float("inf"):
            raise UsageError(f"{flag} must be a finite number of seconds >= 0, got {seconds}")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        raise UsageError(f"--kv-cache-memory must be > 0 MiB, got {args.kv_cache_memory}")


def api_keys(args: argparse.Namespace) -> dict[str, Any] | None:
    """The keys of --api-key and --api-keys-file (the file's policy wins for a key in both);
    None when neither is given."""
    from contbatch.server.auth import KeyPolicy, check_key, load_keys_file

    keys: dict[str, KeyPolicy] = {}
    for key in args.api_keys:
        try:
            keys[check_key(key)] = KeyPolicy()
        except ValueError as exc:
            raise UsageError(f"--api-key: {exc}") from None
    if args.api_keys_file is not None:
        try:
            keys.update(load_keys_file(args.api_keys_file))
        except ValueError as exc:
            raise UsageError(f"--api-keys-file: {exc}") from None
    return keys or None


def build_app(args: argparse.Namespace) -> Any:
    """The FastAPI app the flags describe; `UsageError` for a bad flag."""
    from contbatch.server.app import create_app
    from contbatch.server.backends import BackendError, BackendOptions, make_backend
    from contbatch.server.client import DriverClient
    from contbatch.server.connections import Activity
    from contbatch.server.driver import Gather
    from contbatch.server.serving import ServerConfig
    from contbatch.sim.cost import AffineCost

    _check_flags(args)
    keys = api_keys(args)
    cost = cost_model(args.cost) if args.backend == "sim" else None
    overrides = [*SERVER_DEFAULTS, *args.overrides]
    config = scheduler_config(args.preset, cost if cost is not None else AffineCost(), overrides)
    try:
        kv_bytes = int(args.kv_cache_memory * 1024**2) if args.kv_cache_memory is not None else None
        options = BackendOptions(cost, args.model, args.served_model_name, kv_bytes, args.device, args.dtype)
        backend = make_backend(args.backend, config, options)
    except BackendError as exc:
        raise UsageError(f"--backend {args.backend}: {exc}") from None
    server_config = ServerConfig(
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        shutdown_grace_s=args.shutdown_grace,
        body_timeout_s=args.body_timeout or None,
        tokenizer_workers=args.tokenizer_workers,
        tokenizer_queue=args.tokenizer_queue,
        trust_tenant_header=args.trust_tenant_header,
        api_keys=keys,
    )
    activity = Activity()  # (bytes coming in: a gathered first step waits for a burst still being read)
    gather = Gather(args.gather_gap, args.gather_max, last_activity=activity)
    app = create_app(DriverClient(backend, scheduler=args.scheduler, gather=gather), server_config)
    app.state.http_activity = activity  # (for its connections: `run_http`)
    return app


def uvicorn_options(args: argparse.Namespace, send_buffer: int, activity: Activity | None = None) -> dict[str, Any]:
    """The connection limits of the flags (`--limit-concurrency`, `--header-timeout`), a
    connection's send buffer (bytes), the parser and the event loop (`--http`, `--loop`), and the
    `Activity` its connections touch (None: none), as `uvicorn.Config` options
    (`contbatch.server.connections`). `UsageError` when the parser or the loop named is not
    installed."""
    import importlib.util

    from contbatch.server.connections import limited_protocol

    for flag, choice in (("--http", args.http), ("--loop", args.loop)):
        if choice in ("httptools", "uvloop") and importlib.util.find_spec(choice) is None:
            raise UsageError(f"{flag} {choice}: {choice} is not installed (pip install {choice})")
    return {
        "limit_concurrency": args.limit_concurrency or None,
        "http": limited_protocol(args.header_timeout, send_buffer, args.http, activity),
        "loop": args.loop,
    }


def run_http(app: Any, args: argparse.Namespace, *, command: str, keyed: bool, send_buffer: int, grace_s: int) -> int:
    """Serve `app` under uvicorn on the flags' host and port with their connection limits (`serve`
    and `route` alike), its start-up heap frozen (`freeze_startup_heap`); first a warning when it
    is open beyond this machine without API keys."""
    import uvicorn

    try:
        options = uvicorn_options(args, send_buffer, getattr(app.state, "http_activity", None))
    except UsageError as exc:
        print(f"contbatch {command}: error: {exc}", file=sys.stderr)
        return 2
    if not keyed and args.host not in LOCAL_HOSTS:
        print(
            f"contbatch {command}: warning: serving on {args.host} without --api-key: anyone who reaches it can use it",
            file=sys.stderr,
        )
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=grace_s,
        **options,
    )
    return 0


def run_serve_command(args: argparse.Namespace) -> int:
    try:
        app = build_app(args)
    except UsageError as exc:
        print(f"contbatch serve: error: {exc}", file=sys.stderr)
        return 2
    keyed = app.state.config.api_keys is not None
    grace_s = max(1, round(args.shutdown_grace))
    return run_http(app, args, command="serve", keyed=keyed, send_buffer=args.send_buffer, grace_s=grace_s)
