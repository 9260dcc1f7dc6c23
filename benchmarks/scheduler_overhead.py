"""Scheduler overhead: microseconds per scheduled request per step, contbatch against vLLM's V1.

Drives contbatch's `ContinuousScheduler` on the workload of
`../shared/anchors/vllm_scheduler/drive_vllm_scheduler.py` (same generator, same budgets, same
fake model output) and, side by side in the same run, that baseline driver itself (vLLM's
`Scheduler` in its own virtual environment; see the anchor's README for installing it).

Workload (the anchor's defaults): 2,000 requests, prompts uniform 32-1,024, outputs uniform
16-512 (random.Random(0): all prompt lengths first, then all output lengths); max_num_seqs 256,
max_num_batched_tokens 8,192, block size 16, 32,769 blocks, chunked prefill, no prefix caching;
every request arriving at step 0, or Poisson arrivals (rate per step). The fake model samples one
token for every scheduled request that reached the end of its prompt, none for partial prefill
chunks. Timed: `schedule()` + `update()` per step (building the model output is not timed, as in
the baseline). Headline: us_per_sched_req_aggregate = total timed us / scheduled requests.

    .venv/bin/python benchmarks/scheduler_overhead.py --reps 3 \\
        --vllm-python ~/.cache/contbatch-anchors/vllm-venv/bin/python

Prints one table (medians over repetitions, runs interleaved) and writes JSON (--json-out).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from contbatch.core import ContinuousScheduler, Request, SchedulerConfig, StepResult
from contbatch.core.config import KVConfig

ANCHOR = Path(__file__).resolve().parents[1].parent / "shared" / "anchors" / "vllm_scheduler"
ARRIVALS = {"all_at_once": ("all", 0.0), "poisson0.5": ("poisson", 0.5)}


def workload(args: argparse.Namespace, arrival: str, rate: float) -> tuple[list[int], list[int], list[int]]:
    """The anchor's generator, draw for draw."""
    rng = random.Random(args.seed)
    n = args.num_requests
    prompt_lens = [rng.randint(32, 1024) for _ in range(n)]
    output_lens = [rng.randint(16, 512) for _ in range(n)]
    if arrival == "all":
        return prompt_lens, output_lens, [0] * n
    t, arrive = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrive.append(int(t))
    return prompt_lens, output_lens, arrive


def run_contbatch(args: argparse.Namespace, arrival: str, rate: float) -> dict[str, float]:
    prompt_lens, output_lens, arrive = workload(args, arrival, rate)
    n = len(prompt_lens)
    num_blocks = 256 * math.ceil(2048 / 16) + 1
    config = SchedulerConfig(
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=2048,
        kv=KVConfig(block_size=16, num_blocks=num_blocks, watermark=0.0),
    )
    scheduler = ContinuousScheduler(config)
    requests = [Request(str(i), float(arrive[i]), prompt_lens[i], output_lens[i]) for i in range(n)]
    sampled = (100,)
    gc.collect()
    gc.freeze()
    timed_ns = scheduled = steps = step = next_i = tokens = 0
    clock = time.perf_counter_ns
    while scheduler.num_finished < n:
        while next_i < n and arrive[next_i] <= step:
            scheduler.add_request(requests[next_i], float(step))
            next_i += 1
        if not scheduler.has_unfinished():
            step += 1
            continue
        t0 = clock()
        out = scheduler.schedule(float(step))
        t1 = clock()
        result = StepResult(sampled_token_ids={c.request_id: sampled for c in out.chunks if c.samples})
        t2 = clock()
        scheduler.update(out, result, float(step) + 1.0)
        t3 = clock()
        timed_ns += (t1 - t0) + (t3 - t2)
        scheduled += len(out.chunks)
        tokens += out.num_batched_tokens
        steps += 1
        step += 1
    gc.unfreeze()
    expected = sum(prompt_lens) + sum(output_lens) - n
    if tokens != expected:
        raise SystemExit(f"token accounting differs from the baseline's: {tokens} != {expected}")
    return {
        "us_per_sched_req_aggregate": timed_ns / 1e3 / scheduled,
        "busy_steps": steps,
        "mean_scheduled_reqs_per_step": scheduled / steps,
        "pair_us_mean": timed_ns / 1e3 / steps,
        "total_sched_tokens": tokens,
        "preemptions": scheduler.stats.num_preemptions,
    }


def run_vllm(python: str, args: argparse.Namespace, arrival: str, rate: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [python, str(ANCHOR / "drive_vllm_scheduler.py"), "--json-out", str(out)]
        cmd += ["--num-requests", str(args.num_requests), "--seed", str(args.seed)]
        if arrival == "poisson":
            cmd += ["--arrival", "poisson", "--rate", str(rate)]
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=1800)
        data = json.loads(out.read_text())
    keys = ("us_per_sched_req_aggregate", "busy_steps", "mean_scheduled_reqs_per_step", "pair_us_mean")
    return {k: float(data[k]) for k in keys} | {"total_sched_tokens": data["total_sched_tokens"]}


def median_of(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", help="python of the vLLM anchor's venv; omitted: contbatch only")
    parser.add_argument("--json-out", default="scheduler_overhead.json")
    args = parser.parse_args()
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for rep in range(args.reps):
        for name, (arrival, rate) in ARRIVALS.items():
            entry = results.setdefault(name, {"contbatch": [], "vllm": []})
            entry["contbatch"].append(run_contbatch(args, arrival, rate))
            if args.vllm_python:
                entry["vllm"].append(run_vllm(args.vllm_python, args, arrival, rate))
            print(f"rep {rep + 1}/{args.reps} {name} done", file=sys.stderr, flush=True)
    table = summarize(results)
    print(render(table))
    doc = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "args": vars(args),
        "table": table,
        "runs": results,
    }
    Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")


def summarize(results: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, float | None]]:
    table: dict[str, dict[str, float | None]] = {}
    for name, entry in results.items():
        ours = median_of(entry["contbatch"], "us_per_sched_req_aggregate")
        theirs = median_of(entry["vllm"], "us_per_sched_req_aggregate") if entry["vllm"] else None
        table[name] = {
            "contbatch_us_per_sched_req": round(ours, 3),
            "vllm_us_per_sched_req": None if theirs is None else round(theirs, 3),
            "ratio_contbatch_over_vllm": None if theirs is None else round(ours / theirs, 3),
            "contbatch_steps": median_of(entry["contbatch"], "busy_steps"),
            "vllm_steps": median_of(entry["vllm"], "busy_steps") if entry["vllm"] else None,
            "contbatch_reqs_per_step": round(median_of(entry["contbatch"], "mean_scheduled_reqs_per_step"), 1),
        }
    return table


def render(table: dict[str, dict[str, float | None]]) -> str:
    cols = list(next(iter(table.values())))
    rows = [["workload", *cols]] + [
        [name, *("-" if v is None else f"{v:g}" for v in row.values())] for name, row in table.items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


if __name__ == "__main__":
    main()
