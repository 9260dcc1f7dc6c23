"""`contbatch generate` and `contbatch run`: the real engine from the command line.

- `generate`: prompts in, text out, with timing (TTFT, TPOT, tokens per second), greedy or
  sampled; `--chat` applies the model's chat template.
- `run --trace T`: replays a trace through the real engine in real time (each request sent at its
  arrival time, with a prompt of its token count and its output length forced), once per
  scheduler, and reports with the metrics library (the same table as `compare`).

Without `--model`, the built-in demo model (random weights: meaningless text) is created once and
cached. Bad flags exit 2 with one line; the engine refuses what it cannot run with a reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from contbatch.cli.options import UsageError, scheduler_config
from contbatch.core import SCHEDULERS, Timeline
from contbatch.metrics import format_compare_table, format_number, per_request_table, summarize
from contbatch.sim.cost import AffineCost
from contbatch.traces import TraceError, load_trace

MIB = 1024**2


def add_engine_flags(
    parser: argparse.ArgumentParser,
    *,
    model_default: str | None = None,
    model_help: str = "a local Hugging Face checkpoint directory (default: the demo model)",
) -> None:
    """The flags that configure an engine: --model, --kv-cache-memory, --dtype, --device, --set."""
    parser.add_argument("--model", default=model_default, help=model_help)
    parser.add_argument("--kv-cache-memory", type=float, default=256, metavar="MIB", help="KV cache size in MiB")
    parser.add_argument("--dtype", help="float32 (CPU default), float16 or bfloat16")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="scheduler config field, as for simulate")  # fmt: skip


def add_engine_parsers(commands: Any) -> None:
    generate = commands.add_parser("generate", help="generate text with the real engine",
                                   description="Generate completions for prompts with the real engine.")  # fmt: skip
    generate.add_argument("prompts", nargs="+", help="the prompts")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template (user turns)")
    add_engine_flags(generate)
    run = commands.add_parser(
        "run",
        help="replay a trace through the real engine",
        description="Replay a trace through the real engine in real time, once per scheduler.",
    )
    run.add_argument("--trace", default="seed-scaled", help="a built-in trace or a file (times in seconds)")
    run.add_argument("--schedulers", default="static,continuous", help="comma-separated (default: static,continuous)")
    run.add_argument("--json", action="store_true", help="print the summaries as JSON")
    add_engine_flags(run)


def engine_config(args: argparse.Namespace, kind: str = "continuous", *, model: str | None = None) -> Any:
    """The `EngineConfig` of `add_engine_flags`' flags; `model`: the checkpoint (None: the demo model)."""
    from contbatch.engine.llm_engine import EngineConfig

    if args.kv_cache_memory <= 0:
        raise UsageError(f"--kv-cache-memory must be > 0 MiB, got {args.kv_cache_memory}")
    config = scheduler_config("engine", AffineCost(), args.overrides)
    return EngineConfig(model=model, kv_cache_memory=int(args.kv_cache_memory * MIB), dtype=args.dtype,
                        device=args.device, scheduler=config, scheduler_kind=kind)  # fmt: skip


def run_generate_command(args: argparse.Namespace) -> int:
    from contbatch.engine.api import LLM
    from contbatch.loop.params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens)  # fmt: skip
        config = engine_config(args, model=args.model)
    except (UsageError, ValueError) as exc:
        print(f"contbatch generate: error: {exc}", file=sys.stderr)
        return 2
    try:
        llm = LLM(config=config)
    except (OSError, ValueError) as exc:
        print(f"contbatch generate: cannot load the model: {exc}", file=sys.stderr)
        return 2
    prompts: list[str | list[int]] = [_chat(llm, p) if args.chat else p for p in args.prompts]
    start = time.monotonic()
    outputs = llm.generate(prompts, params)
    elapsed = time.monotonic() - start
    for output in outputs:
        m = per_request_table([output.timeline])[0]
        timing = f"ttft {format_number(m.ttft)} s, tpot {format_number(m.tpot)} s" if m.ttft is not None else ""
        print(f"--- {output.request_id} ({output.finish_reason.value}; {len(output.token_ids)} tokens; {timing})")
        print(output.text)
    total = sum(len(o.token_ids) for o in outputs)
    print(f"--- {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s); model {llm.engine.model_path}")
    return 0


def _chat(llm: Any, prompt: str) -> list[int]:
    """The chat prompt's token ids, as transformers' apply_chat_template(tokenize=True) gives them."""
    ids: list[int] = llm.engine.tokenizer.chat_prompt_ids([{"role": "user", "content": prompt}])
    return ids


def run_run_command(args: argparse.Namespace) -> int:
    from contbatch.engine.llm_engine import LLMEngine
    from contbatch.engine.replay import replay

    try:
        kinds = [k.strip() for k in args.schedulers.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in SCHEDULERS]
        if unknown or not kinds:
            raise UsageError(f"--schedulers: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(SCHEDULERS)}")
        trace = load_trace(args.trace, time_unit="s")
        configs = {kind: engine_config(args, kind, model=args.model) for kind in kinds}
    except (UsageError, TraceError) as exc:
        print(f"contbatch run: error: {exc}", file=sys.stderr)
        return 2
    first: LLMEngine | None = None
    summaries: dict[str, dict[str, object]] = {}
    timelines: dict[str, list[Timeline]] = {}
    for kind, config in configs.items():
        engine = LLMEngine(config, share=first)
        first = first or engine
        timelines[kind] = replay(engine, trace)
        summaries[kind] = summarize(timelines[kind], time_unit="s")
    if args.json:
        import json

        print(json.dumps({"trace": trace.name, "model": str(first.model_path) if first else None,
                          "results": summaries}, indent=2))  # fmt: skip
        return 0
    print(f"trace: {trace.name} ({len(trace)} requests) - {trace.source}")
    print(f"model: {first.model_path if first else '-'}\n")
    print(format_compare_table(summaries))
    for kind, tls in timelines.items():
        rows = per_request_table(tls)
        cells = ", ".join(
            f"{m.request_id}: ttft {format_number(m.ttft)} s, done {format_number(m.e2e)} s" for m in rows
        )
        print(f"{kind}: {cells}")
    return 0
