"""Speculative decoding with prompt-lookup (n-gram) drafts against the same engine without it, in
one run, on a repetitive trace.

Model: the built-in demo model (30M parameters, random weights: under greedy decoding it falls
into loops, as real models repeat code, tables and quoted text), float32 on CPU (--threads) or
--device. Trace: --requests prompts, each a random phrase of 6-12 tokens repeated 4-8 times
(seeded), greedy, --max-tokens output tokens each (ignore_eos). Runs, interleaved over --reps
repetitions (the order rotated per repetition, after a warm-up): the engine without speculation
(k = 0) and with k = each of --k draft tokens, at
each of --concurrency (requests in flight together: 1 is single-stream latency, where
speculation helps most; more requests fill the step anyway). Every run is checked token for
token against k = 0.

Reported per (concurrency, k), medians over repetitions: output tokens per second over the
makespan, mean TPOT (ms per output token after the first, per request), loop steps, output
tokens per step, the draft acceptance rate (accepted / proposed drafts) and the speed-up (k = 0's
makespan over this run's, paired per repetition) and the same in process CPU time (steadier on a
machine shared with other jobs). Prints a table; writes JSON.

    .venv/bin/python benchmarks/spec_decode.py --json-out spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contbatch.core import SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.engine.executor import DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN, ModelExecutor
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.loop.params import SamplingParams


def trace(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(3, 32_000) for _ in range(rng.randint(6, 12))]
        prompts.append(phrase * rng.randint(4, 8))
    return prompts


@dataclass
class Run:
    makespan_s: float
    cpu_s: float  # the process's CPU time over the run (robust to other jobs on a shared machine)
    output_tokens: int
    tpot_ms: float
    steps: int
    proposed: int
    accepted: int
    outputs: list[list[int]]


def run(base: LLMEngine, config: EngineConfig, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Run:
    engine = LLMEngine(config, share=base)
    executor = engine.core.executor
    assert isinstance(executor, ModelExecutor)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    live: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    steps = 0
    start = time.perf_counter()
    cpu_start = time.process_time()
    while pending or engine.has_unfinished():
        while pending and len(live) < concurrency:
            index, prompt = pending.pop(0)
            request = engine.add_request(prompt, params, request_id=f"q{index}")
            live[request.request_id] = index
        engine.core.take_outputs()
        for out in engine.step():
            index = live[out.request_id]
            if out.token_ids:
                outputs.setdefault(index, []).extend(out.token_ids)
                times.setdefault(index, []).append(time.perf_counter())
            if out.is_final:
                del live[out.request_id]
        steps += 1
    makespan = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    tpots = [
        (t[-1] - t[0]) / (len(outputs[i]) - 1) * 1000 for i, t in times.items() if len(outputs[i]) > 1 and len(t) > 1
    ]
    return Run(
        makespan_s=makespan,
        cpu_s=cpu,
        output_tokens=sum(len(o) for o in outputs.values()),
        tpot_ms=statistics.fmean(tpots) if tpots else 0.0,
        steps=steps,
        proposed=executor.num_proposed_tokens,
        accepted=executor.num_accepted_tokens,
        outputs=[outputs[i] for i in range(len(prompts))],
    )


def summarize(runs: dict[tuple[int, int], list[Run]], levels: list[int], ks: list[int]) -> list[dict[str, Any]]:
    """One row per (concurrency, k); SystemExit when a run's tokens differ from k = 0's."""
    rows = []
    for c in levels:
        reference = runs[(c, 0)]
        for k in ks:
            got = runs[(c, k)]
            for r in got:
                if r.outputs != reference[0].outputs:
                    raise SystemExit(f"concurrency {c}, k {k}: the outputs differ from k = 0")
            proposed = sum(r.proposed for r in got)
            rows.append(
                {
                    "concurrency": c,
                    "k": k,
                    "tokens_per_s": statistics.median(r.output_tokens / r.makespan_s for r in got),
                    "tpot_ms": statistics.median(r.tpot_ms for r in got),
                    "steps": statistics.median(r.steps for r in got),
                    "tokens_per_step": statistics.median(r.output_tokens / r.steps for r in got),
                    "acceptance": sum(r.accepted for r in got) / proposed if proposed else None,
                    "speedup": statistics.median(
                        ref.makespan_s / r.makespan_s for ref, r in zip(reference, got, strict=True)
                    ),
                    "cpu_speedup": statistics.median(
                        ref.cpu_s / r.cpu_s for ref, r in zip(reference, got, strict=True)
                    ),
                    "makespan_s": statistics.median(r.makespan_s for r in got),
                    "cpu_s": statistics.median(r.cpu_s for r in got),
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'conc':>4} {'k':>2} {'tok/s':>8} {'TPOT ms':>8} {'steps':>6} {'tok/step':>8} {'accept':>7} "
        f"{'speed-up':>8} {'cpu speed-up':>12}"
    )
    print(header)
    for row in rows:
        accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(
            f"{row['concurrency']:>4} {row['k']:>2} {row['tokens_per_s']:>8.1f} {row['tpot_ms']:>8.2f} "
            f"{row['steps']:>6.0f} {row['tokens_per_step']:>8.2f} {accept:>7} {row['speedup']:>7.2f}x "
            f"{row['cpu_speedup']:>11.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", default="2,4", help="draft tokens per step to compare with k = 0 (comma-separated)")
    parser.add_argument("--concurrency", default="1,8", help="requests in flight (comma-separated)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default="spec_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [0, *(int(k) for k in args.k.split(","))]
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = trace(args.requests, args.seed)

    def config(k: int) -> EngineConfig:
        scheduler = SchedulerConfig(num_speculative_tokens=k, kv=KVConfig())
        return EngineConfig(device=args.device, scheduler=scheduler)

    base = LLMEngine(config(0))
    for c in levels:  # warm-up: every step shape once, discarded
        for k in ks:
            run(base, config(k), prompts[:2], c, 16)
    runs: dict[tuple[int, int], list[Run]] = {(c, k): [] for c in levels for k in ks}
    for rep in range(args.reps):
        for c in levels:
            # interleaved, the order rotated per repetition: a drift in machine speed hits every k alike
            for k in ks[rep % len(ks) :] + ks[: rep % len(ks)]:
                runs[(c, k)].append(run(base, config(k), prompts, c, args.max_tokens))
    rows = summarize(runs, levels, ks)
    print_table(rows)
    result: dict[str, Any] = {
        "benchmark": "spec_decode",
        "model": str(base.model_path),
        "device": str(base.runner.device),
        "threads": args.threads,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "prompt_lookup_min_max": [DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX],
        "machine": platform.machine(),
        "rows": rows,
    }
    Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
