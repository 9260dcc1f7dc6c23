"""The real engine against transformers on one shared trace, side by side in one process.

Model: the built-in demo model (30M parameters: hidden 384, 6 layers, vocabulary 32,000), float32,
2 threads. Trace: N requests, prompts uniform 16-1,024 tokens, outputs uniform 8-512, Poisson
arrivals fast enough to saturate the engine. Three runs:
  - contbatch continuous (the core scheduler, paged KV, chunked prefill);
  - contbatch static (the same engine, batch barrier);
  - transformers `generate` in static batches of up to --hf-batch requests that have arrived,
    prompts left-padded, greedy, max_new_tokens = the longest output in the batch (a request's
    tokens past its own length are padding, not counted).
Reported per run: output tokens per second over the makespan, p50/p99 TTFT, mean TPOT. Plus a
decode-only step of 32 requests at context ~160 in the engine against the compute and memory
roofline measured here (matmul GFLOP/s and streaming bandwidth).

    .venv/bin/python benchmarks/engine_vs_hf.py --requests 48 --json-out engine_vs_hf.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from contbatch.core import FinishReason
from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.engine.runner import SequenceState
from contbatch.engine.sampling import SamplingParams


def workload(n: int, rate: float, seed: int) -> list[tuple[float, list[int], int]]:  # see Workload
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        prompt = [rng.randrange(3, 32_000) for _ in range(rng.randint(16, 1024))]
        out.append((t, prompt, rng.randint(8, 512)))
        t += rng.expovariate(rate)
    return out


def summarize(ttfts: list[float], tpots: list[float], tokens: int, makespan: float) -> dict[str, float]:
    q = statistics.quantiles(ttfts, n=100)
    return {"tokens_per_s": tokens / makespan, "p50_ttft_s": statistics.median(ttfts), "p99_ttft_s": q[98],
            "mean_tpot_ms": 1000 * statistics.fmean(tpots), "makespan_s": makespan}  # fmt: skip


Workload = list[tuple[float, list[int], int]]  # (arrival s, prompt token ids, output tokens)


def run_engine(kind: str, reqs: Workload, share: LLMEngine | None) -> tuple[dict[str, float], LLMEngine]:
    engine = LLMEngine(EngineConfig(kv_cache_memory=512 * 1024**2, scheduler_kind=kind), share=share)
    start, sent, pending = time.monotonic(), [], list(reqs)
    while pending or engine.has_unfinished():
        now = time.monotonic()
        while pending and start + pending[0][0] <= now:
            arrival, prompt, out = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
            sent.append(engine.add_request(prompt, params, arrival_ts=start + arrival))
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, start + pending[0][0] - time.monotonic()))
    assert all(r.finish_reason is FinishReason.LENGTH for r in sent)
    ttfts = [r.timeline.token_ts[0] - r.timeline.arrival_ts for r in sent]
    tpots = [(r.timeline.token_ts[-1] - r.timeline.token_ts[0]) / (len(r.timeline.token_ts) - 1) for r in sent]
    end = max(r.timeline.finished_ts or 0.0 for r in sent)
    return summarize(ttfts, tpots, sum(r.num_output_tokens for r in sent), end - start), engine


def run_hf(model: object, reqs: Workload, batch: int) -> dict[str, float]:
    start, pending, ttfts, tpots, tokens = time.monotonic(), list(reqs), [], [], 0
    while pending:
        now = time.monotonic() - start
        if pending[0][0] > now:
            time.sleep(pending[0][0] - now)
            now = pending[0][0]
        group = [r for r in pending if r[0] <= now][:batch]
        del pending[: len(group)]
        longest, new = max(len(p) for _, p, _ in group), max(o for _, _, o in group)
        ids = torch.tensor([[0] * (longest - len(p)) + p for _, p, _ in group])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for _, p, _ in group])
        t0 = time.monotonic()
        with torch.no_grad():  # the first token's time: one prefill + first sample
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)  # type: ignore[attr-defined]
        first = time.monotonic()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,  # type: ignore[attr-defined]
                           pad_token_id=0)  # fmt: skip
        done = time.monotonic()
        per_token = (done - t0 - (first - t0)) / max(1, new - 1)
        for arrival, _, out in group:
            ttfts.append(first - t0 + (t0 - start) - arrival)
            tpots.append(per_token)
            tokens += out
    return summarize(ttfts, tpots, tokens, time.monotonic() - start)


def decode_step_vs_roofline(engine: LLMEngine, batch: int = 32, context: int = 160) -> dict[str, float]:
    runner, spec = engine.runner, engine.runner.spec
    bs = runner.kv_cache.block_size
    blocks = -(-(context + 1) // bs)
    seqs, chunks = {}, []
    for i in range(batch):
        rid = f"d{i}"
        table = list(range(i * blocks, (i + 1) * blocks))
        seqs[rid] = SequenceState([5] * (context + 1), table, SamplingParams(temperature=0.0))
        chunks.append(ScheduledChunk(rid, context, 1, False, True))
    out = build_output(0, chunks)
    for _ in range(3):
        runner.execute(out, seqs)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        runner.execute(out, seqs)
        times.append(time.perf_counter() - t)
    params = sum(p.numel() for p in runner.model.parameters()) if hasattr(runner.model, "parameters") else 34_000_000
    peak, bandwidth = matmul_flops(), stream_bandwidth(roofline_bytes(spec, params, batch, context))
    roofline = roofline_ms(spec, params, batch, context, peak=peak, bandwidth=bandwidth) / 1000
    step = statistics.median(times)
    return {"decode32_step_ms": 1000 * step, "roofline_ms": 1000 * roofline, "ratio": step / roofline,
            "gflops": peak / 1e9, "bandwidth_gbs": bandwidth / 1e9}  # fmt: skip


def roofline_bytes(spec: Any, params: int, batch: int, context: float) -> int:
    """What `roofline_ms` counts as read: the `params` float32 weights and the batch's K/V."""
    kv_bytes = 2 * 4 * batch * context * spec.num_layers * spec.num_kv_heads * spec.head_dim
    return int(4 * params + kv_bytes)


def roofline_ms(spec: Any, params: int, batch: int, context: float, *, peak: float, bandwidth: float) -> float:
    """A decode step of `batch` requests at `context`: max(FLOPs / peak, bytes / bandwidth), float32,
    every one of the `params` weights read and multiplied once, plus attention over the K/V read
    (`bandwidth`: `stream_bandwidth` of about `roofline_bytes`)."""
    flops = 2 * params * batch + 4 * batch * context * spec.num_layers * spec.num_heads * spec.head_dim
    return 1000 * max(flops / peak, roofline_bytes(spec, params, batch, context) / bandwidth)


def matmul_flops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(3):
        a @ b
    return 3 * 2 * n**3 / (time.perf_counter() - t)


def stream_bandwidth(n: int = 256 * 1024**2) -> float:
    """Bytes/s of summing `n` bytes of float32, again and again: memory's streaming bandwidth when
    `n` is larger than the CPU's caches (a probe that fits the last-level cache measures the cache:
    on a CPU with an effective L3 of 64-128 MB, 52 GB/s at 64 MB and 25 GB/s from 128 MB up). A
    roofline passes the bytes it counts, so its memory term reads as many as the step does."""
    x = torch.ones(n // 4)
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    return 5 * n / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default="engine_vs_hf.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    reqs = workload(args.requests, args.rate, args.seed)
    results: dict[str, dict[str, float]] = {}
    results["contbatch-continuous"], engine = run_engine("continuous", reqs, None)
    results["contbatch-static"], _ = run_engine("static", reqs, engine)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(ensure_demo_model(), dtype=torch.float32).eval()
    results["transformers-static"] = run_hf(model, reqs, args.hf_batch)
    roofline = decode_step_vs_roofline(engine)
    hf = results["transformers-static"]
    ours = results["contbatch-continuous"]
    ratios = {
        "throughput_x": ours["tokens_per_s"] / hf["tokens_per_s"],
        "p50_ttft_x": hf["p50_ttft_s"] / ours["p50_ttft_s"],
    }
    cols = ["tokens_per_s", "p50_ttft_s", "p99_ttft_s", "mean_tpot_ms", "makespan_s"]
    rows = [["run", *cols]] + [[name, *(f"{r[c]:.4g}" for c in cols)] for name, r in results.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols) + 1)]
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows))
    print(f"continuous vs transformers: throughput {ratios['throughput_x']:.2f}x, "
          f"p50 TTFT {ratios['p50_ttft_x']:.1f}x lower")  # fmt: skip
    print(f"decode step of 32 at context 160: {roofline['decode32_step_ms']:.1f} ms, "
          f"roofline {roofline['roofline_ms']:.1f} ms ({roofline['ratio']:.2f}x; {roofline['gflops']:.0f} GFLOP/s, "
          f"{roofline['bandwidth_gbs']:.1f} GB/s measured)")  # fmt: skip
    doc = {"args": vars(args), "results": results, "ratios": ratios, "decode_step": roofline}
    Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
