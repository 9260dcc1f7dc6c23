"""The load generator's own CPU per streamed token: `contbatch bench` of this working tree against a
baseline commit's, side by side in one run.

    .venv/bin/python benchmarks/bench_client.py --baseline COMMIT [--reps 5] [--requests 48]

On a machine of two cores the client shares the CPUs with the server it measures (every
`engine_vs_peer.py` run), and on a fast server its CPU per token bounds the rate it can measure.
One `contbatch serve --backend sim` server of this working tree (the cost model `affine:base_ms=5`
paced in real time: the server's work is its HTTP side and step loop) takes, in each repetition
and on either side (the order alternating), a child process that imports the bench client, then
runs `contbatch bench --json` twice: ``--requests`` streaming completions of ``--output-len``
tokens all at once, then as many at ``--rate`` a second. Measured in the child around the two
runs (imports excluded): its process CPU time per output token, and each run's p50 TTFT and
output tokens/s as the client reports them. The table gives medians over the repetitions and the
baseline over this tree (> 1: this tree's client costs less). Writes JSON (``--json-out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers
from baseline_src import ROOT, export_src, run_side

# the child: imports first, then the two runs under its own CPU clock; one JSON line
CHILD = """
import contextlib, io, json, sys, time
import contbatch.bench.runner, contbatch.bench.client, contbatch.bench.report
from contbatch.cli.main import main
url, n, out, rate = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
common = ["bench", "--base-url", url, "--model", "contbatch-sim", "--num-prompts", n, "--input-len", "256",
          "--output-len", out, "--ignore-eos", "--seed", "1", "--disable-tqdm", "--json"]
docs, cpu = [], time.process_time()
for r in ("inf", rate):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        if main([*common, "--request-rate", r]) != 0:
            sys.exit("bench failed")
    docs.append(json.loads(buffer.getvalue()))
cpu = time.process_time() - cpu
tokens = sum(d["total_output_tokens"] for d in docs)
print(json.dumps({"cpu_s": cpu, "tokens": tokens, "us_per_token": 1e6 * cpu / tokens,
                  "burst_p50_ttft_ms": docs[0]["median_ttft_ms"], "burst_tok_s": docs[0]["output_throughput"],
                  "rate_p50_ttft_ms": docs[1]["median_ttft_ms"], "failed": sum(d["failed"] for d in docs)}))
"""
KEYS = ("us_per_token", "burst_p50_ttft_ms", "burst_tok_s", "rate_p50_ttft_ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the commit whose bench client is the baseline")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=48, help="requests per workload (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rate", type=float, default=16.0, help="requests/s of the second workload")
    parser.add_argument("--json-out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_client.json")
    args = parser.parse_args()
    if args.reps < 1 or args.requests < 1 or args.output_len < 1 or not args.rate > 0:
        parser.error("--reps, --requests, --output-len and --rate must be positive")
    from contbatch.bench.servers import contbatch_argv, free_port, running_server

    git = ["git", "-C", str(ROOT), "rev-parse", args.baseline]
    commit = subprocess.run(git, check=False, capture_output=True, text=True).stdout.strip() or args.baseline

    port = free_port()
    argv = contbatch_argv("serve", "--backend", "sim", "--cost", "affine:base_ms=5", port=port)
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as tmp, running_server(argv, port) as server:
        sides = {"baseline": export_src(args.baseline, Path(tmp)), "current": None}
        cmd = [sys.executable, "-c", CHILD, server.url, str(args.requests), str(args.output_len), str(args.rate)]
        for rep in range(args.reps):
            for side in list(sides) if rep % 2 == 0 else list(reversed(sides)):
                result = run_side(cmd, sides[side], side)
                if result["failed"]:
                    sys.exit(f"{side}: {result['failed']} requests failed")
                runs[side].append(result)
                print(f"rep {rep + 1}/{args.reps} {side} done", file=sys.stderr, flush=True)
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in KEYS} for side, rs in runs.items()}
    print(f"{'measure':28s} {'baseline':>10s} {'current':>10s} {'baseline/current':>17s}")
    for key in KEYS:
        b, c = medians["baseline"][key], medians["current"][key]
        print(f"{key:28s} {b:10.1f} {c:10.1f} {b / c:16.2f}x")
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "baseline_commit": commit}
    doc |= {"medians": medians, "runs": runs}
    args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
