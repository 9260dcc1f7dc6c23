"""Cluster simulator speed (issue 16, item 7): 16 replicas serving the `azure-code` trace tiled
to 1,000,000 requests at a rate the fleet sustains, in at most 120 s and 2 GB.

The trace: azure-code's 8,819 requests copied back to back in time (arrival gaps kept) until
`--requests`, then scaled to `--rate` (default 16 x azure-code's own mean rate of 2.57 req/s,
about 41 req/s: each replica at the rate one replica sustains, so the queues stay bounded:
TTFT per 100,000-request slice is reported to show it). The fleet: `--replicas` replicas of
`roofline:llama-2-7b@a100` under the `engine` preset (8,192-token steps, 256 sequences, 6,144
KV blocks of 16 tokens) behind `least_outstanding`, streaming mode (one compact row per
request), decode runs on (`contbatch.sim.cluster_runs`; `--no-runs` steps every step).

Reported: `build_s` (the trace), `sim_s` (the simulation, wall time), `sim_cpu_s` (its CPU time:
steadier than `sim_s` on a shared machine), `summary_s` (every metric), `cpu_s` (the whole
process: interpreter, imports, trace, simulation, summary), peak RSS, steps, and the simulated
requests per second. Each run is a fresh process. With --baseline REF the same run follows on the
code of git commit REF (exported to a temporary folder and imported from there), reported as
`baseline_*` with `baseline_sim_cpu_speedup` (its simulation CPU time over ours) and
`same_results` (equal steps, completions and latency figures). Writes JSON (--json-out).

    .venv/bin/python benchmarks/cluster_speed.py                    # 1,000,000 requests
    .venv/bin/python benchmarks/cluster_speed.py --requests 100000 --no-runs
    .venv/bin/python benchmarks/cluster_speed.py --requests 100000 --baseline HEAD
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers
from baseline_src import export_src, run_side

TTFT_SLICE = 100_000  # requests per slice of the TTFT-over-time check
SAME = ("steps", "completed", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_ttft_ms_by_slice")


def tiled_trace(num_requests: int, rate: float) -> Any:
    """azure-code copied back to back until `num_requests`, arrival times scaled to mean `rate`."""
    from contbatch.traces import Trace, TraceRequest, load_trace

    base = load_trace("azure-code").requests
    first, last = base[0].arrival_ts, base[-1].arrival_ts
    period = (last - first) + (last - first) / (len(base) - 1)  # one mean gap between copies
    scale = (len(base) / period) / rate  # azure's mean rate over a period, to `rate`
    requests = []
    for i in range(num_requests):
        copy, r = divmod(i, len(base))
        spec = base[r]
        requests.append(
            TraceRequest(
                f"{copy}-{spec.request_id}",
                (spec.arrival_ts - first + copy * period) * scale,
                spec.num_prompt_tokens,
                spec.num_output_tokens,
                max_output_tokens=spec.max_output_tokens,
            )
        )
    source = f"azure-code tiled to {num_requests} requests at {rate} req/s"
    return Trace("azure-code-tiled", tuple(requests), "s", source)


def run_one(num_requests: int, rate: float, replicas: int, runs: bool) -> dict[str, Any]:
    from contbatch.core import PRESETS
    from contbatch.sim import parse_cost
    from contbatch.sim.cluster import simulate_cluster
    from contbatch.sim.cluster_config import aggregated

    start = time.perf_counter()
    trace = tiled_trace(num_requests, rate)
    built = time.perf_counter()
    fleet = aggregated(parse_cost("roofline:llama-2-7b@a100"), PRESETS["engine"], replicas)
    cpu_start = time.process_time()
    result = simulate_cluster(trace, fleet, keep_timelines=False, decode_runs=runs)
    sim_cpu = time.process_time() - cpu_start
    simulated = time.perf_counter()
    summary = result.summary()
    summarized = time.perf_counter()
    assert result.streaming is not None
    rows = result.streaming.rows
    slices = [rows[i : i + TTFT_SLICE] for i in range(0, len(rows), TTFT_SLICE)]
    ttft_ms = [1000 * sum(r.ttft or 0.0 for r in s) / max(1, sum(1 for r in s if r.ttft is not None)) for s in slices]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "requests": num_requests,
        "rate": rate,
        "replicas": replicas,
        "decode_runs": runs,
        "steps": sum(r.num_steps for r in result.replicas),
        "build_s": built - start,
        "sim_s": simulated - built,
        "sim_cpu_s": sim_cpu,
        "summary_s": summarized - simulated,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "requests_per_s": num_requests / (simulated - built),
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "completed": summary["completed"],
        "mean_ttft_ms": summary["mean_ttft_ms"],
        "p99_ttft_ms": summary["p99_ttft_ms"],
        "mean_tpot_ms": summary["mean_tpot_ms"],
        "mean_ttft_ms_by_slice": [round(v, 1) for v in ttft_ms],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=16 * 8819 / 3436.3, help="req/s (default 16 x azure-code's)")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--no-runs", action="store_true", help="step every step (no decode runs)")
    parser.add_argument("--baseline", metavar="REF", help="then run the same on the code of this git commit")
    parser.add_argument("--in-process", action="store_true", help="(internal) run here and print JSON")
    parser.add_argument("--json-out", default="cluster_speed.json")
    args = parser.parse_args()
    if args.in_process:
        print(json.dumps(run_one(args.requests, args.rate, args.replicas, not args.no_runs)))
        return
    cmd = [sys.executable, __file__, "--in-process", "--requests", str(args.requests), "--rate", str(args.rate),
           "--replicas", str(args.replicas), *(["--no-runs"] if args.no_runs else [])]  # fmt: skip
    result = run_side(cmd, None, "cluster_speed")
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            baseline = run_side(cmd, export_src(args.baseline, Path(tmp)), "cluster_speed")
        result["baseline"] = args.baseline
        for key in ("sim_s", "sim_cpu_s", "cpu_s", "peak_rss_mb"):
            result[f"baseline_{key}"] = baseline[key]
        result["baseline_sim_cpu_speedup"] = baseline["sim_cpu_s"] / result["sim_cpu_s"]
        result["same_results"] = all(baseline[key] == result[key] for key in SAME)
    result["machine"] = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
