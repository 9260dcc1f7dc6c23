"""contbatch's `vllm` preset against vLLM V1's scheduler, decision for decision.

Drives both schedulers on the workload of the vLLM anchor driver
(`../shared/anchors/vllm_scheduler/drive_vllm_scheduler.py`: N requests, prompts uniform
32-1,024 tokens, outputs uniform 16-512, `random.Random(seed)` drawing every prompt length first,
then every output length; max_num_seqs 256, max_num_batched_tokens 8,192, block size 16,
chunked prefill; all at step 0 or Poisson arrivals per step; a fake model that samples one token
for every scheduled request that reached the end of its prompt, none for partial prefill chunks,
never an EOS) and records, step by step, the scheduled request ids with their token counts and
the requests preempted. vLLM runs in its own virtual environment (`--vllm-python`; see the
anchor's README); the same script, run there with `--side vllm`, imports only vLLM.

Prints, per workload variant (arrivals x KV blocks x prefix caching), the step count,
preemptions and total scheduled tokens of both, whether every step is identical, and the first
step where they differ (with both decisions); writes JSON (--json-out). `--record PATH` also
writes vLLM's per-step digests: tests/core/data/vllm_decisions_small.json, which the test suite
checks contbatch against without vLLM installed, was recorded with

    .venv/bin/python benchmarks/vllm_decisions.py --vllm-python ~/.cache/contbatch-anchors/vllm-venv/bin/python \
        --num-requests 150 --record tests/core/data/vllm_decisions_small.json --json-out /tmp/small.json

The full comparison (2,000 requests per variant, a few minutes):

    .venv/bin/python benchmarks/vllm_decisions.py --vllm-python ~/.cache/contbatch-anchors/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

Decisions = dict[str, Any]  # {"steps": [[[rid, tokens], ...], ...], "preempted": [[rid, ...], ...]}


def workload(args: argparse.Namespace) -> tuple[list[int], list[int], list[int]]:
    """(prompt lengths, output lengths, arrival steps), as the anchor driver draws them."""
    rng = random.Random(args.seed)
    n = args.num_requests
    plens = [rng.randint(args.prompt_min, args.prompt_max) for _ in range(n)]
    olens = [rng.randint(args.out_min, args.out_max) for _ in range(n)]
    if args.arrival == "all":
        return plens, olens, [0] * n
    t, arrive = 0.0, []
    for _ in range(n):
        t += rng.expovariate(args.rate)
        arrive.append(int(t))
    return plens, olens, arrive


def num_blocks(args: argparse.Namespace) -> int:
    return args.num_blocks or args.max_num_seqs * math.ceil(args.max_model_len / args.block_size) + 1


def prompt_ids(i: int, length: int) -> list[int]:
    """The anchor's distinct prompts (no accidental prefix-cache hits between requests)."""
    return [(i * 7919 + k) % 50_000 + 3 for k in range(length)]


# -- contbatch --------------------------------------------------------------------------------------
def run_contbatch(args: argparse.Namespace) -> Decisions:
    from contbatch.core import ContinuousScheduler, Request, StepResult, preset_config
    from contbatch.core.block_hashes import prompt_block_hashes
    from contbatch.core.config import SchedulerConfig

    base = preset_config("vllm")
    assert base.kv is not None
    # vLLM's block pool keeps block 0 as its null block: it hands out one block fewer
    kv = {
        "num_blocks": num_blocks(args) - 1,
        "block_size": args.block_size,
        "enable_prefix_caching": args.prefix_caching,
    }
    config = SchedulerConfig.from_dict(
        {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len,
            "kv": kv,
        },
        base=base,
    )
    s = ContinuousScheduler(config)
    plens, olens, arrive = workload(args)
    requests = []
    for i, (p, o) in enumerate(zip(plens, olens, strict=True)):
        ids = prompt_ids(i, p)
        hashes = prompt_block_hashes(ids, args.block_size) if args.prefix_caching else ()
        requests.append(Request(str(i), float(arrive[i]), p, o, block_hashes=hashes))
    steps: list[list[list[Any]]] = []
    preempted: list[list[str]] = []
    step, next_i, finished = 0, 0, 0
    while finished < len(requests):
        while next_i < len(requests) and arrive[next_i] <= step:
            s.add_request(requests[next_i], float(step))
            next_i += 1
        if not s.has_unfinished():
            step += 1
            continue
        out = s.schedule(float(step))
        steps.append([[c.request_id, c.num_new_tokens] for c in out.chunks])
        preempted.append(list(out.preempted_ids))
        sampled = {c.request_id: (100,) for c in out.chunks if c.samples}
        finished += len(s.update(out, StepResult(sampled_token_ids=sampled), float(step + 1)))
        step += 1
    return {"steps": steps, "preempted": preempted}


# -- vLLM (run under its own interpreter) -----------------------------------------------------------
def run_vllm(args: argparse.Namespace) -> Decisions:  # pragma: no cover - needs the vLLM venv
    from vllm import __version__
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched, hasher = vllm_scheduler(args)
    plens, olens, arrive = workload(args)
    params = [SamplingParams(ignore_eos=True, max_tokens=n, temperature=0.0) for n in olens]
    reqs = [Request(request_id=str(i), prompt_token_ids=prompt_ids(i, p), sampling_params=params[i],
                    pooling_params=None, block_hasher=hasher) for i, p in enumerate(plens)]  # fmt: skip
    steps: list[list[list[Any]]] = []
    preempted: list[list[str]] = []
    before = dict.fromkeys(range(len(reqs)), 0)
    step, next_i, finished = 0, 0, 0
    while finished < len(reqs):
        while next_i < len(reqs) and arrive[next_i] <= step:
            sched.add_request(reqs[next_i])
            next_i += 1
        if not sched.has_requests():
            step += 1
            continue
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        steps.append([[rid, so.num_scheduled_tokens[rid]] for rid in ids])
        now = {i: r.num_preemptions for i, r in enumerate(reqs)}
        preempted.append([str(i) for i in range(len(reqs)) if now[i] > before[i]])
        before = now
        sampled = [[100] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                sampled_token_ids=sampled)  # fmt: skip
        for outs in sched.update_from_output(so, mro).values():
            finished += sum(1 for o in outs.outputs if o.finish_reason is not None)
        step += 1
    return {"steps": steps, "preempted": preempted, "vllm_version": __version__}


def vllm_scheduler(args: argparse.Namespace) -> tuple[Any, Any]:  # pragma: no cover - needs the vLLM venv
    """vLLM's V1 `Scheduler` as the anchor driver builds it, and its block hasher (None without
    prefix caching)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CUDA wheel finds no platform without it
    model_dir = os.path.join(os.path.expanduser("~/.cache/contbatch-anchors"), "fake-opt-125m")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        from transformers import OPTConfig

        OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                  max_position_embeddings=2048, torch_dtype="float16", bos_token_id=2, eos_token_id=2,
                  pad_token_id=1).save_pretrained(model_dir)  # fmt: skip
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs, blocks = args.block_size, num_blocks(args)
    model_config = ModelConfig(model=model_dir, trust_remote_code=True, dtype="float16", seed=42,
                               skip_tokenizer_init=True, max_model_len=args.max_model_len)  # fmt: skip
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        long_prefill_token_threshold=0,
        disable_chunked_mm_input=False,
        enable_chunked_prefill=True,
        async_scheduling=False,
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    cache_config = CacheConfig(block_size=bs, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=args.prefix_caching)  # fmt: skip
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
                             parallel_config=ParallelConfig(pipeline_parallel_size=1))  # fmt: skip
    group = KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    )
    kv_cache_config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[group])
    cache_config.num_gpu_blocks = blocks
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=bs, log_stats=False,
                      structured_output_manager=StructuredOutputManager(vllm_config))  # fmt: skip
    if not args.prefix_caching:
        return sched, None
    hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return sched, get_request_block_hasher(bs, hash_fn)


# -- comparison --------------------------------------------------------------------------------------
def first_divergence(ours: Decisions, theirs: Decisions) -> dict[str, Any] | None:
    for i, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=False)):
        pa, pb = sorted(ours["preempted"][i]), sorted(theirs["preempted"][i])
        if a != b or pa != pb:
            return {"step": i, "contbatch": a, "vllm": b, "contbatch_preempted": pa, "vllm_preempted": pb}
    if len(ours["steps"]) != len(theirs["steps"]):
        return {"step": min(len(ours["steps"]), len(theirs["steps"])), "note": "one ran out of steps"}
    return None


def step_digests(d: Decisions) -> list[str]:
    """One short digest per step of its decision (scheduled ids and tokens in order, preempted
    ids): two runs' digests are equal exactly where their decisions are."""
    return [
        hashlib.sha1(json.dumps([step, sorted(pre)]).encode()).hexdigest()[:10]
        for step, pre in zip(d["steps"], d["preempted"], strict=True)
    ]


def totals(d: Decisions) -> dict[str, int]:
    return {
        "steps": len(d["steps"]),
        "preemptions": sum(len(p) for p in d["preempted"]),
        "scheduled_tokens": sum(n for step in d["steps"] for _, n in step),
    }


WORKLOAD_ARGS = ("num_requests", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                 "prompt_min", "prompt_max", "out_min", "out_max", "rate", "seed")  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    f"{arrival}-{blocks or 'ample'}{'-prefix' if prefix else ''}": {
        "arrival": arrival,
        "num_blocks": blocks,
        "prefix_caching": prefix,
    }
    for prefix in (False, True)
    for arrival in ("all", "poisson")
    for blocks in (0, 3000, 1500)
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0, help="0: max_num_seqs * ceil(max_model_len / block) + 1")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--out-min", type=int, default=16)
    p.add_argument("--out-max", type=int, default=512)
    p.add_argument("--arrival", choices=["all", "poisson"], default="all")
    p.add_argument("--rate", type=float, default=0.5, help="poisson: mean arrivals per step")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side", choices=["vllm", "contbatch"], help="record one side (internal)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--vllm-python", help="the vLLM anchor venv's python")
    p.add_argument("--json-out", default="vllm_decisions.json")
    p.add_argument("--record", help="also write vLLM's per-step digests here (the test fixture)")
    return p


def variant_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """`args` with the workload variant `name` applied."""
    return argparse.Namespace(**{**vars(args), "prefix_caching": False, **VARIANTS[name]})


def record_vllm(vllm_python: str, variant: argparse.Namespace) -> Decisions:
    """vLLM's decisions on `variant`, recorded in its own interpreter."""
    skip = ("side", "variants", "vllm_python", "json_out", "record", "prefix_caching")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(variant).items() if k not in skip and v is not None]
    flags += ["--prefix-caching"] if variant.prefix_caching else []
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}  # the CUDA wheel finds no platform without it
    done = subprocess.run([vllm_python, __file__, "--side", "vllm", *flags],
                          check=False, capture_output=True, text=True, cwd=Path.home(), env=env)  # fmt: skip
    if done.returncode:
        sys.exit(f"vLLM's side failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    decisions: Decisions = json.loads(done.stdout.strip().splitlines()[-1])
    return decisions


def main() -> None:
    args = parser().parse_args()
    if args.side:
        print(json.dumps(run_vllm(args) if args.side == "vllm" else run_contbatch(args)))
        return
    if not args.vllm_python:
        sys.exit("--vllm-python is needed (the vLLM anchor's venv; see ../shared/anchors/vllm_scheduler/README.md)")
    report: dict[str, Any] = {}
    fixture: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k in WORKLOAD_ARGS}, "variants": {}}
    print(f"{'variant':20s} {'steps':>15s} {'preemptions':>11s} {'scheduled tokens':>19s}  decisions")
    for name in args.variants.split(","):
        variant = variant_args(args, name)
        theirs = record_vllm(args.vllm_python, variant)
        ours = run_contbatch(variant)
        row = report[name] = {
            "contbatch": totals(ours),
            "vllm": totals(theirs),
            "first_divergence": first_divergence(ours, theirs),
        }
        fixture["vllm_version"] = theirs["vllm_version"]
        fixture["variants"][name] = {"totals": totals(theirs), "digests": step_digests(theirs)}
        pair = {
            k: f"{row['contbatch'][k]}/{row['vllm'][k]}"
            if row["contbatch"][k] != row["vllm"][k]
            else str(row["vllm"][k])
            for k in row["vllm"]
        }
        same = "identical" if row["first_divergence"] is None else f"differ from step {row['first_divergence']['step']}"
        print(
            f"{name:20s} {pair['steps']:>15s} {pair['preemptions']:>11s} {pair['scheduled_tokens']:>19s}  {same}",
            flush=True,
        )
    print("(a/b: contbatch/vLLM where they differ)")
    Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.record:
        Path(args.record).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
