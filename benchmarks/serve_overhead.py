"""The server's own CPU per streamed token, by HTTP parser and event loop (issue 19: on a CPU engine
the HTTP side shares the model's cores).

    .venv/bin/python benchmarks/serve_overhead.py [--reps 5] [--requests 48] [--output-len 256]

Each variant is a `contbatch serve --backend sim` process (the cost model paced in real time, so
the model's own work is absent and what the server spends is its HTTP side, its step loop and
its text streams), started on 127.0.0.1 with ``--http PARSER --loop LOOP``:

- ``h11+asyncio``: uvicorn's pure-Python parser and asyncio's event loop (the server before
  this change: `contbatch.server.connections` built on h11 alone);
- ``httptools+uvloop``: the C parser and the C event loop (`--http auto --loop auto` when both
  are installed, as `pyproject.toml` now asks).

`contbatch bench` (in this process, as `engine_vs_peer.py` drives every server) sends
``--requests`` streaming completions of ``--output-len`` tokens all at once, then the same number
at ``--rate`` a second. Measured per run, from /proc: the CPU time of the server's main thread
(the event loop: HTTP parsing, routing, validation, tokenization, SSE) and of the whole server
process, each per output token received. The variants alternate, ``--reps`` times each, in one
script run (the machine's speed drifts); the table gives medians and the ratio of the C variant
to the pure-Python one (< 1: it costs less). Writes JSON (``--json-out``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"h11+asyncio": ("h11", "asyncio"), "httptools+uvloop": ("httptools", "uvloop")}
MODEL = "contbatch-sim"


def cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) so far of process `pid` (all its threads), or of its thread `tid`."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(url: str, flags: list[str]) -> dict[str, Any]:
    """`contbatch bench --json` against `url` in this process: its summary document."""
    from contbatch.cli.main import main

    argv = ["bench", "--base-url", url, "--model", MODEL, "--timeout", "120", "--disable-tqdm", "--json", *flags]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"contbatch {' '.join(argv)} exited {code}")
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def one_run(variant: str, args: argparse.Namespace) -> dict[str, float]:
    """Start the variant's server, warm it up, run the workload: CPU per output token."""
    from contbatch.bench.servers import contbatch_argv, free_port, running_server

    parser, loop = VARIANTS[variant]
    port = free_port()
    argv = contbatch_argv("serve", "--backend", "sim", "--http", parser, "--loop", loop, port=port)
    workload = ["--num-prompts", str(args.requests), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--ignore-eos", "--seed", "1"]  # fmt: skip
    with running_server(argv, port, log=args.work_dir / f"{variant}.log") as server:
        pid = server.process.pid
        bench(server.url, ["--num-prompts", "8", "--input-len", "32", "--output-len", "8", "--request-rate", "inf"])
        main0, all0, wall0 = cpu_s(pid, pid), cpu_s(pid), time.monotonic()
        tokens = 0
        for rate in ("inf", str(args.rate)):
            doc = bench(server.url, [*workload, "--request-rate", rate])
            if doc.get("failed"):
                raise RuntimeError(f"{variant}: {doc['failed']} requests failed: {doc.get('errors')}")
            tokens += int(doc["total_output_tokens"])
        main1, all1, wall = cpu_s(pid, pid), cpu_s(pid), time.monotonic() - wall0
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "main_thread_cpu_s": main1 - main0,
        "server_cpu_s": all1 - all0,
        "main_thread_us_per_token": (main1 - main0) / tokens * 1e6,
        "server_us_per_token": (all1 - all0) / tokens * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=48, help="requests per workload (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rate", type=float, default=16.0, help="requests/s of the second workload")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/contbatch-serve-overhead"))
    parser.add_argument("--json-out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_overhead.json")
    args = parser.parse_args()
    if args.reps < 1 or args.requests < 1 or args.output_len < 1 or not args.rate > 0:
        parser.error("--reps, --requests, --output-len and --rate must be positive")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            runs[variant].append(one_run(variant, args))
            print(f"rep {rep + 1}/{args.reps} {variant} done", file=sys.stderr, flush=True)
    medians = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    ratios = {
        key: statistics.median(n[key] / b[key] for b, n in zip(*runs.values(), strict=True))
        for key in ("main_thread_us_per_token", "server_us_per_token")
    }
    print(f"{'variant':18s} {'main thread µs/token':>21s} {'server µs/token':>16s} {'tokens':>7s}")
    for variant, m in medians.items():
        print(
            f"{variant:18s} {m['main_thread_us_per_token']:21.1f} {m['server_us_per_token']:16.1f}"
            f" {m['output_tokens']:7.0f}"
        )
    main_ratio, server_ratio = ratios["main_thread_us_per_token"], ratios["server_us_per_token"]
    print(f"httptools+uvloop / h11+asyncio (median of paired ratios): main thread {main_ratio:.2f}x,", end=" ")
    print(f"whole server {server_ratio:.2f}x; medians of {args.reps} alternating runs")
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "medians": medians, "ratios": ratios}
    args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
