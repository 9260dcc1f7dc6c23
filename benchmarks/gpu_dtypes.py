"""The engine and transformers per dtype on one device: first use, same shapes again, new shapes.

`benchmarks/gpu_check.sh` times each dtype once, float32 then bfloat16 then float16, each in a
fresh `LLMEngine` and a fresh transformers model: on an H200 the half-precision runs took 10-12
times float32's (engine 7.1 s against 0.60 s). This script separates a kernel's first use from
the steady cost. Each (side, dtype) runs in its own process, which does the same work four times:
on prompt set 0 (cold: the process's first use of every kernel and shape), on set 0 again (same
shapes), then on sets 1 and 2 (new prompt lengths, hence new shapes: what a server meets all the
time; their median is reported). Sides:

- `engine`: the engine as it is (`contbatch.engine.attention.attention_kernels`: on CUDA only
  attention backends whose kernels are built ahead), with `torch.profiler`'s top ops of one more
  run on set 0;
- `engine-cudnn`: the engine with PyTorch's own choice of attention backend (the code before
  `attention_kernels`: cuDNN's for half precision on Hopper, which plans each new shape); on the
  CPU the same as `engine`;
- `transformers`: `generate`, one prompt at a time (--transformers-dtypes).

The work is gpu_check's: --prompts random prompts of 16-512 tokens, --new-tokens greedy tokens
each; the engine takes a set all at once (continuous batching, chunked prefill). Prints one
table, writes JSON (--json-out).

    python benchmarks/gpu_dtypes.py --device cuda --json-out gpu_dtypes.json
    python benchmarks/gpu_dtypes.py --device cpu --dtypes float32 --prompts 4 --new-tokens 8   # plumbing
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import contbatch.engine.attention
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.loop.params import SamplingParams

Prompts = list[list[int]]
Runner = Callable[[Prompts], object]
SETS = (0, 0, 1, 2)  # the prompt set of each timed run: cold, same shapes, new shapes twice


def make_prompts(count: int, seed: int) -> Prompts:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32_000) for _ in range(rng.randint(16, 512))] for _ in range(count)]


def synced(device: str, work: Callable[[], object]) -> float:
    """Seconds `work` took, the device's queue drained before and after."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    work()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t


def engine_runner(path: str, device: str, dtype: str, new_tokens: int) -> Runner:
    engine = LLMEngine(EngineConfig(model=path, device=device, dtype=dtype, kv_cache_memory=256 * 2**20))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def run(prompts: Prompts) -> None:
        for p in prompts:
            engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()

    return run


def transformers_runner(path: str, device: str, dtype: str, new_tokens: int) -> Runner:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos

    def run(prompts: Prompts) -> None:
        for p in prompts:
            ids = torch.tensor([p], device=device)
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                               pad_token_id=0)  # fmt: skip

    return run


def top_ops(device: str, work: Callable[[], object], count: int = 12) -> dict[str, list[dict[str, object]]]:
    """The ops of one run of `work` with the most self time, on the device and on the host (ms)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        synced(device, work)
    out = {}
    for side, attr in (("device", "self_device_time_total"), ("host", "self_cpu_time_total")):
        ranked = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0.0), reverse=True)[:count]
        out[side] = [{"op": e.key[:120], "calls": e.count, "self_ms": round(getattr(e, attr, 0.0) / 1000, 3)}
                     for e in ranked if getattr(e, attr, 0.0) > 0]  # fmt: skip
    return out


def worker(side: str, device: str, dtype: str, prompts: int, new_tokens: int) -> dict[str, object]:
    """One (side, dtype) in this process: the timed runs over `SETS`, and the engine's profile."""
    if side == "engine-cudnn":
        contbatch.engine.attention.CUDA_ATTENTION_BACKENDS = None  # PyTorch's own choice
    path = str(ensure_demo_model())
    make = transformers_runner if side == "transformers" else engine_runner
    run = make(path, device, dtype, new_tokens)
    sets = {k: make_prompts(prompts, k) for k in set(SETS)}
    times = [synced(device, lambda k=k: run(sets[k])) for k in SETS]
    out: dict[str, object] = {"runs_s": [round(t, 4) for t in times], "cold_s": times[0], "same_s": times[1],
                              "new_s": statistics.median(times[2:])}  # fmt: skip
    if side == "engine":
        out["profile_same_shapes"] = top_ops(device, lambda: run(sets[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--transformers-dtypes", default="float32,bfloat16", help="where transformers runs too")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json-out")
    ap.add_argument("--worker", nargs=2, metavar=("SIDE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        side, dtype = args.worker
        print(json.dumps(worker(side, args.device, dtype, args.prompts, args.new_tokens)))
        return
    doc: dict[str, object] = {"device": args.device, "prompts": args.prompts, "new_tokens": args.new_tokens,
                              "sets": SETS, "torch": torch.__version__, "results": {}}  # fmt: skip
    if args.device.startswith("cuda"):
        doc["gpu"] = torch.cuda.get_device_name(args.device)
    results: dict[str, dict[str, object]] = doc["results"]  # type: ignore[assignment]
    print(f"{'dtype':<9} {'side':<13} {'cold s':>8} {'same shapes s':>14} {'new shapes s':>13}", flush=True)
    for dtype in args.dtypes.split(","):
        sides = ["engine", "engine-cudnn"] + (["transformers"] if dtype in args.transformers_dtypes.split(",") else [])
        for side in sides:
            cmd = [sys.executable, __file__, "--device", args.device, "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens), "--worker", side, dtype]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{side} {dtype} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
            r = results.setdefault(dtype, {})[side] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{dtype:<9} {side:<13} {r['cold_s']:>8.3f} {r['same_s']:>14.3f} {r['new_s']:>13.3f}", flush=True)
    for dtype, sides in results.items():
        prof = sides["engine"]["profile_same_shapes"]  # type: ignore[index]
        print(f"-- {dtype}, engine, one run on set 0 again, top device / host ops (self ms):")
        for where in ("device", "host"):
            print(f"   {where}: " + "; ".join(f"{o['op'][:60]} {o['self_ms']} ({o['calls']})" for o in prof[where][:5]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
