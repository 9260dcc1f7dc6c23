"""Simulator speed: simulated requests per wall-second and iterations (steps) per second.

Workloads (issue: "the simulator as a planning tool"):
  (a) 10,000 requests, Poisson 10.5 req/s, 512 prompt and 128 output tokens each, a vLLM-like
      configuration (max 128 sequences, 4,096-token budget, paged KV), under the Llama-2-7B on
      A100 roofline preset: the workload on which Vidur simulated ~400-550 requests per
      wall-second on this machine class;
  (b) the azure-code trace tiled in time to 1,000,000 requests (copies back to back, arrival
      gaps kept), in streaming mode (no timelines kept), with its peak memory (ru_maxrss).

Each workload runs in a fresh process per repetition (so peak memory is its own); medians of
--reps runs. Also runs (a) with skip-ahead off, side by side, for the ratio. With --baseline REF
it also runs (a) on the simulator as it was at git commit REF (exported to a temporary folder and
imported from there), interleaved with the current code's runs, and reports the ratio: absolute
rates differ about 2x between machines of one kind, ratios in one run do not. The simulation
(`simulate`) and the summary of its results (`SimResult.summary`: every metric, percentiles
over every inter-token gap) are timed apart: requests_per_s is the simulation's rate,
with_summary_per_s the rate of both. Prints one table; writes JSON (--json-out).

    .venv/bin/python benchmarks/sim_speed.py --reps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("a", "a-no-skip", "b")
BASELINE = "a-baseline"  # workload (a) on the code of --baseline


def trace_a():  # type: ignore[no-untyped-def]
    from contbatch.traces.synthetic import fixed, generate, poisson

    return generate("speed-a", 10_000, poisson(10.5), fixed(512), fixed(128), seed=1)


def trace_b(num_requests: int):  # type: ignore[no-untyped-def]
    from contbatch.traces import Trace, load_trace

    base = load_trace("azure-code")
    period = base.requests[-1].arrival_ts + (base.requests[-1].arrival_ts / (len(base) - 1))
    requests = []
    copy = 0
    while len(requests) < num_requests:
        for r in base.requests:
            if len(requests) == num_requests:
                break
            shifted = r.arrival_ts + copy * period
            requests.append(dataclasses.replace(r, request_id=f"{copy}-{r.request_id}", arrival_ts=shifted))
        copy += 1
    return Trace("azure-code-x", tuple(requests), "s", f"azure-code tiled to {num_requests} requests")


def run_one(workload: str, num_b: int) -> dict[str, float]:
    from contbatch.core import PRESETS, ContinuousScheduler
    from contbatch.sim import parse_cost, simulate

    cost = parse_cost("roofline:llama-2-7b@a100")
    if workload.startswith(("a", "base")):
        trace = trace_a()
        config = dataclasses.replace(PRESETS["engine"], max_num_seqs=128, max_num_batched_tokens=4096)
    else:
        trace = trace_b(num_b)
        config = PRESETS["engine"]
    start = time.perf_counter()
    result = simulate(
        trace, ContinuousScheduler(config), cost, skip_ahead=workload != "a-no-skip", keep_timelines=workload != "b"
    )
    simulated = time.perf_counter()
    summary = result.summary()
    summarized = time.perf_counter()
    sim_s, summary_s = simulated - start, summarized - simulated
    return {
        "requests": len(trace),
        "steps": result.num_steps,
        "sim_s": sim_s,
        "summary_s": summary_s,
        "requests_per_s": len(trace) / sim_s,
        "with_summary_per_s": len(trace) / (sim_s + summary_s),
        "iterations_per_s": result.num_steps / sim_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "makespan_s": float(summary["makespan"]),  # type: ignore[arg-type]
        "completed": float(summary["completed"]),  # type: ignore[arg-type]
    }


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests-b", type=int, default=1_000_000)
    parser.add_argument("--only", choices=WORKLOADS, help="run one workload in this process (internal)")
    parser.add_argument("--json-out", default="sim_speed.json")
    parser.add_argument("--baseline", metavar="REF", help="also run (a) on the code of this git commit")
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run_one(args.only, args.requests_b)))
        return
    workloads = (*WORKLOADS, BASELINE) if args.baseline else WORKLOADS
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            export = subprocess.run(["git", "archive", args.baseline, "src"], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=export.stdout, check=True)
        for rep in range(args.reps):
            for workload in workloads:
                only = "a" if workload == BASELINE else workload
                cmd = [sys.executable, __file__, "--only", only, "--requests-b", str(args.requests_b)]
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                if workload == BASELINE:
                    env["PYTHONPATH"] = str(Path(tmp) / "src")
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                runs[workload].append(json.loads(out.strip().splitlines()[-1]))
                print(f"rep {rep + 1}/{args.reps} {workload} done", file=sys.stderr, flush=True)
    table = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
    cols = ["requests", "steps", "sim_s", "summary_s", "requests_per_s", "with_summary_per_s", "iterations_per_s",
            "peak_rss_mb"]  # fmt: skip
    rows = [["workload", *cols]] + [[w, *(_fmt(table[w][c]) for c in cols)] for w in workloads]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols) + 1)]
    print("\n".join("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows))
    skip_ratio = table["a"]["requests_per_s"] / table["a-no-skip"]["requests_per_s"]
    print(f"skip-ahead speed-up on (a): {skip_ratio:.2f}x")
    doc: dict[str, object] = {"python": platform.python_version(), "machine": platform.machine(), "table": table}
    if args.baseline:
        ratios = {
            key: statistics.median(n[key] / b[key] for n, b in zip(runs["a"], runs[BASELINE], strict=True))
            for key in ("requests_per_s", "with_summary_per_s")
        }
        print(f"(a) against {args.baseline}: simulation {ratios['requests_per_s']:.2f}x, "
              f"with the summary {ratios['with_summary_per_s']:.2f}x (medians of paired runs)")  # fmt: skip
        doc["baseline"] = {"ref": args.baseline, "ratios": ratios}
    doc["runs"] = runs
    Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
