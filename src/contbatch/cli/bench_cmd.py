"""`contbatch bench`: replay a workload against an OpenAI-compatible endpoint and report it.

The workload is ``--trace`` (a built-in or a file, at its own arrival times, or rescaled with
``--request-rate``) or synthetic: ``--num-prompts`` requests with Poisson arrivals at
``--request-rate`` (``inf``, the default: all at once) or gamma arrivals with ``--burstiness``,
prompts of ``--input-len`` and outputs of ``--output-len`` tokens (``--range-ratio`` spreads
them uniformly). Each request's ``max_tokens`` is its output length: exact with ``--ignore-eos``,
at most that otherwise.

Requests are plain OpenAI (streaming, ``stream_options.include_usage``, temperature 0), so any
OpenAI-compatible server takes them. Server extensions are sent only when asked: ``--ignore-eos``
(vLLM's ``ignore_eos``: outputs run to ``max_tokens``), ``--continuous-usage-stats`` (vLLM's
``stream_options.continuous_usage_stats``: exact token counts per chunk), ``--priority`` (vLLM's
``priority``, from the trace), ``--extra-body JSON`` (any fields). Against ``contbatch serve`` or
vLLM, ``--ignore-eos --continuous-usage-stats`` reproduces a trace's lengths and per-chunk timing.

Results: a table on stdout (``--json``: the JSON document), and with ``--save-result`` the JSON
document in ``--result-dir`` (``--result-filename``, default a dated name) plus per-request JSONL
beside it. ``--warmup S`` / ``--cooldown S`` leave out requests scheduled in the first / last S
seconds; ``--goodput ttft:MS tpot:MS e2el:MS`` adds SLO goodput.

Bad flags exit 2 with one line on stderr; a run in which every request failed exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contbatch.cli.options import UsageError

if TYPE_CHECKING:
    from contbatch.bench.client import Target


def add_bench_parser(commands: Any) -> None:
    """Register ``bench`` on the subparsers object of the main parser."""
    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible endpoint with a trace or synthetic arrivals",
        description="Replay a trace (or synthetic arrivals) against an OpenAI-compatible endpoint; report "
        "TTFT, TPOT, ITL, E2E, throughput and goodput from client-side timelines.",
    )
    bench.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    bench.add_argument("--model", required=True, help="the model id to request")
    bench.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    bench.add_argument("--trace", help="a built-in trace or a .jsonl/.csv file, in seconds")
    bench.add_argument("--request-rate", type=float, help="requests per second (inf: all at once)")
    bench.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals, CV^2 of the gaps (1: Poisson)")
    bench.add_argument("--num-prompts", type=int, default=100)
    bench.add_argument("--input-len", type=int, default=256, help="prompt tokens (synthetic)")
    bench.add_argument("--output-len", type=int, default=128, help="output tokens (synthetic)")
    bench.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len x [1 - r, 1 + r]")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    bench.add_argument("--warmup", type=float, default=0.0, metavar="S", help="leave out the first S seconds")
    bench.add_argument("--cooldown", type=float, default=0.0, metavar="S", help="leave out the last S seconds")
    bench.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    bench.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request read timeout")
    bench.add_argument("--header", action="append", default=[], metavar="K:V", help="extra HTTP header")
    ext = bench.add_argument_group(
        "server extensions",
        "Requests are plain OpenAI by default; these add fields that only some servers accept (a strict "
        "OpenAI-compatible server, e.g. `transformers serve`, refuses an unknown field with HTTP 422).",
    )
    ext.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send vLLM's `ignore_eos: true`: every output runs to its max_tokens (contbatch serve, vLLM, SGLang)",
    )
    ext.add_argument(
        "--continuous-usage-stats",
        action="store_true",
        help="send vLLM's `stream_options.continuous_usage_stats: true`: usage in every chunk, so tokens per chunk "
        "are counted exactly (default: one token per chunk with text, the final usage adding the rest)",
    )
    ext.add_argument(
        "--priority",
        action="store_true",
        help="send each request's trace priority as vLLM's `priority` field (with a priority scheduler)",
    )
    ext.add_argument(
        "--extra-body",
        metavar="JSON",
        help="a JSON object merged into every request body, last (e.g. '{\"min_tokens\": 16}')",
    )
    bench.add_argument("--save-result", action="store_true", help="write the JSON results and per-request JSONL")
    bench.add_argument("--result-dir", type=Path, default=Path("."))
    bench.add_argument("--result-filename", help="default: contbatch-bench-<model>-<date>.json")
    bench.add_argument("--json", action="store_true", help="print the JSON results")
    bench.add_argument("--disable-tqdm", action="store_true")


def _check(args: argparse.Namespace) -> None:
    rate = args.request_rate
    if rate is not None and not (rate > 0):
        raise UsageError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not (math.isfinite(args.burstiness) and args.burstiness > 0):
        raise UsageError(f"--burstiness must be > 0, got {args.burstiness}")
    for flag, value in (
        ("--num-prompts", args.num_prompts),
        ("--input-len", args.input_len),
        ("--output-len", args.output_len),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not 0 <= args.range_ratio < 1:
        raise UsageError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    for flag, value in (("--warmup", args.warmup), ("--cooldown", args.cooldown), ("--timeout", args.timeout)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} must be a number >= 0, got {value}")


def _workload(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    from contbatch.bench import workload
    from contbatch.traces import TraceError

    try:
        if args.trace:
            trace = workload.load(args.trace, request_rate=args.request_rate)
        else:
            rate = args.request_rate if args.request_rate is not None else math.inf
            trace = workload.synthetic_trace(
                args.num_prompts,
                request_rate=rate,
                burstiness=args.burstiness,
                input_len=args.input_len,
                output_len=args.output_len,
                range_ratio=args.range_ratio,
                seed=args.seed,
            )
        return trace, workload.from_trace(trace, seed=args.seed)
    except (TraceError, ValueError) as exc:
        raise UsageError(f"--trace: {exc}" if args.trace else str(exc)) from None


def _headers(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or not key.strip():
            raise UsageError(f"--header {item!r}: expected NAME:VALUE")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def _extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--extra-body: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--extra-body: expected a JSON object, got {type(value).__name__}")
    return value


def _target(args: argparse.Namespace) -> Target:
    from contbatch.bench.client import Target

    return Target(
        args.base_url,
        args.model,
        chat=args.endpoint == "chat",
        headers=_headers(args.header),
        ignore_eos=args.ignore_eos,
        continuous_usage_stats=args.continuous_usage_stats,
        send_priority=args.priority,
        extra_body=_extra_body(args.extra_body),
    )


def run_bench_command(args: argparse.Namespace) -> int:
    import asyncio

    from contbatch.bench.report import (
        BenchError,
        parse_goodput,
        request_records,
        summarize_records,
        to_text,
        write_results,
    )
    from contbatch.bench.runner import RunConfig, run
    from contbatch.collector import freeze_startup_heap

    try:
        _check(args)
        slo = parse_goodput(args.goodput) if args.goodput else None
        trace, requests = _workload(args)
        target = _target(args)
    except (UsageError, BenchError) as exc:
        print(f"contbatch bench: error: {exc}", file=sys.stderr)
        return 2
    if not target.send_priority and any(r.priority for r in requests):
        print("contbatch bench: note: the trace has priorities; they are sent only with --priority", file=sys.stderr)
    config = RunConfig(max_concurrency=args.max_concurrency, timeout_s=args.timeout, progress=not args.disable_tqdm)
    freeze_startup_heap()
    started = time.time()
    records = asyncio.run(run(requests, target, config))
    info = {
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        "backend": "openai-chat" if target.chat else "openai",
        "base_url": args.base_url,
        "endpoint": target.url,
        "model_id": args.model,
        "trace": trace.name,
        "trace_source": trace.source,
        "request_rate": "inf" if args.request_rate is None or math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "warmup_s": args.warmup,
        "cooldown_s": args.cooldown,
        "extensions": target.extensions,
    }
    try:
        doc = summarize_records(records, warmup_s=args.warmup, cooldown_s=args.cooldown, slo=slo, run_info=info)
    except BenchError as exc:
        print(f"contbatch bench: error: {exc}", file=sys.stderr)
        return 2
    if args.save_result:
        name = args.result_filename or f"contbatch-bench-{Path(args.model).name}-{info['date']}.json"
        rows = request_records(records, warmup_s=args.warmup, cooldown_s=args.cooldown)
        jsonl = write_results(doc, rows, args.result_dir / name)
        print(f"results: {args.result_dir / name}  per request: {jsonl}", file=sys.stderr)
    print(json.dumps(doc, indent=2, allow_nan=False) if args.json else to_text(doc))
    return 0 if doc.get("completed") else 1
