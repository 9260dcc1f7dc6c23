"""The attention metadata of one engine step, and a step it matters to: the working tree against
a baseline commit, in one run.

Each repetition runs one worker subprocess per side (the baseline's `src` exported with
`git archive`), the order alternating; every number is the median over the repetitions. A
worker measures, on the CPU:

- `build_metadata` in process CPU time (the mean of --calls calls) for: a 2,048-token chunk
  after a 2,048-token prefix (a long prompt's second chunk), 32 decodes at contexts 80-320 (a
  server's mixed decode batch), and 7 whole prompts of 290 tokens;
- with the demo model (2 threads), the median wall time of `ModelRunner.execute` of that
  2,048-token chunk after its prefix (`engine_step.runner_step`).

Before the tenth session the metadata built what only the torch attention path reads (a later
chunk's context slots and its [chunk, context] causal mask, the decode groups' masks) even when
the native kernels read the step in place; now those are built on first use.

    flock /tmp/contbatch-bench.lock .venv/bin/python benchmarks/step_metadata.py --baseline f4ec9c3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers
from baseline_src import alternating, parse_or_work, run_side

ROOT = Path(__file__).resolve().parent.parent


def cases() -> dict[str, tuple[list[Any], list[int]]]:
    from contbatch.engine.attention import ChunkLayout

    decodes = [ChunkLayout(i, 1, 80 + 240 * i // 31, list(range(30 * i, 30 * i + 21))) for i in range(32)]
    prompts = [ChunkLayout(290 * i, 290, 0, list(range(20 * i, 20 * i + 19))) for i in range(7)]
    return {
        "chunk 2048 after 2048": ([ChunkLayout(0, 2048, 2048, list(range(256)))], [2047]),
        "32 decodes, contexts 80-320": (decodes, list(range(32))),
        "7 prompts of 290": (prompts, [290 * i + 289 for i in range(7)]),
    }


def worker(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from engine_step import runner_step

    from contbatch.engine.attention import build_metadata
    from contbatch.engine.llm_engine import EngineConfig, LLMEngine

    torch.set_num_threads(2)
    result: dict[str, float] = {}
    for name, (layouts, rows) in cases().items():
        build_metadata(layouts, rows, block_size=16, device=torch.device("cpu"))
        start = time.process_time()
        for _ in range(args.calls):
            build_metadata(layouts, rows, block_size=16, device=torch.device("cpu"))
        result[f"metadata {name}: CPU ms"] = 1000 * (time.process_time() - start) / args.calls
    engine = LLMEngine(EngineConfig(kv_cache_memory=512 * 1024**2))
    step = runner_step(engine.runner, [2048], args.steps, prompt=2048)
    result["step, chunk 2048 after 2048: ms"] = step["step_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="f4ec9c3", help="the commit compared against")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50, help="build_metadata calls per case")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of the long chunk (median)")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "step_metadata.json"))
    args = parse_or_work(parser, worker)
    if args is None:
        return
    cmd = [sys.executable, __file__, "--worker", "--calls", str(args.calls), "--steps", str(args.steps)]
    runs = alternating(args.baseline, args.reps, lambda src, side: run_side(cmd, src, side))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    rows = [["measure", "baseline", "current", "baseline/current"]]
    rows += [
        [k, f"{med['baseline'][k]:.3f}", f"{v:.3f}", f"{med['baseline'][k] / v:.2f}x"]
        for k, v in med["current"].items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]))
    print(f"medians of {args.reps} runs per side; baseline {args.baseline}")
    doc = {"args": vars(args), "medians": med, "runs": runs}
    Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
