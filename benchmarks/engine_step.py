"""Decode-step speed of the engine: the working tree against a baseline commit, in one run.

The baseline's `src` is exported with `git archive` into a temporary directory; each repetition
runs one worker subprocess per side (PYTHONPATH = that side's `src`), the order alternating
between repetitions, and every number reported is the median over the repetitions. A worker
loads the demo model (30M, float32) with --threads threads and measures:

- the decode-only step of B requests at context --context (B in --batches), and (--mixed, the
  default) of B requests whose contexts are spread over [context / 2, 2 context] (rows the torch
  attention path pads and masks; the roofline at their mean context), and (--scattered, the
  default) of B requests at --context whose KV blocks are drawn at random from the whole cache
  (a server's block tables once requests have come and gone; the others' blocks follow one
  another, which the CPU's prefetchers read faster), as
  `engine_vs_hf.decode_step_vs_roofline` does: `ModelRunner.execute` of B single-token chunks,
  wall and process CPU time per step (the median of --steps steps after 3 warm-up steps), and
  the time inside the model's `forward` (the rest is the runner's host work: input building,
  sampling);
- the roofline of that step, measured in the same process: matmul GFLOP/s and streaming
  bandwidth (`engine_vs_hf.matmul_flops`, `stream_bandwidth` over as many bytes as the largest
  decode step's roofline counts: a smaller probe can fit the last-level cache, which the step's
  weights and K/V do not; before the twentieth session it read 64 MB); `roofline_ms` counts every
  parameter of the model, as engine_vs_hf does, `roofline_mm_ms` only the weights the step
  multiplies (the decoder layers and the LM head; the embedding is a lookup of B rows);
- a prefill-only step of --prefill COUNTxLENGTH whole prompts (default 7 of 290 tokens: 2,030,
  the token budget of `engine_vs_peer.py`'s servers), against the same matmul peak
  (`prefill_roofline_ms`: every layer weight times every token, causal attention, the LM head for
  one row a prompt);
- (--shared, the default) the largest batch's decode step and the prefill step again while one
  other process spins on a core (`one_spinner`): a serving engine shares its cores with its HTTP
  side and, in these benchmarks, with the client; a kernel that splits its work statically over
  the threads waits for the one that lost its core;
- the same decode steps of B requests with every native kernel a no-op (`kernels_as_no_ops`;
  "kernels no-ops"): what a step costs besides the kernels' arithmetic (Python, torch's dispatch
  and small tensors, ctypes, the runner's host work);
- the host overhead of full engine steps at --engine-batch requests: `LLMEngine.step()`
  (scheduling, input building, forward, sampling, detokenization) timed after every request's
  prefill, with the time inside `forward` subtracted; the fraction is (step - forward) / step;
- which LM head a greedy step reads (`argmax_head`: "tiles" or "vectors", the bfloat16 argmax
  kernels of `contbatch.engine.argmax_head`, or "float32" where neither runs).

Wall time on this 2-vCPU machine is polluted by anything else running, so the ratios against
the baseline measured in the same run are the result, not the absolute numbers. Each worker
starts once /proc/stat shows an idle machine (up to --quiet-wait seconds), and a run whose
batch-32 step used under 80 % of threads x wall time in CPU time (it lost a core to another job)
is discarded and run again (up to --retries times; the discarded runs are kept in the JSON).
Run it alone, under the benchmark lock:

    flock /tmp/contbatch-bench.lock .venv/bin/python benchmarks/engine_step.py
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers
from baseline_src import alternating, parse_or_work
from machine_load import busy_fraction

ROOT = Path(__file__).resolve().parent.parent


# -- worker (runs against whichever `contbatch` PYTHONPATH names) ---------------------------------------


class ForwardTimer:
    """Wraps a model's `forward`: the seconds spent inside it and the token count of each call."""

    def __init__(self, model: Any) -> None:
        self.inner: Callable[..., Any] = model.forward
        self.seconds = 0.0
        self.tokens: list[int] = []
        model.forward = self

    def __call__(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner(input_ids, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.tokens.append(int(input_ids.shape[0]))


def count_params(model: Any) -> tuple[int, int]:
    """(every parameter of the model, the parameters the decode step multiplies)."""
    layers = sum(
        t.numel()
        for layer in model.layers
        for f in dataclasses.fields(layer)
        if (t := getattr(layer, f.name)) is not None
    )
    head = model.lm_head_t.numel()
    tied = model.spec.tie_word_embeddings
    total = layers + head + model.final_norm.numel() + (0 if tied else model.embed.numel())
    return total, layers + head


def mixed_contexts(batch: int, context: int) -> list[int]:
    """`batch` contexts spread evenly over [context / 2, 2 context] (mean 1.25 context), as a
    server's running requests differ: rows of one step that the torch path pads and masks."""
    low, high = context // 2, 2 * context
    return [low + (high - low) * i // max(batch - 1, 1) for i in range(batch)]


def runner_step(
    runner: Any, contexts: list[int], steps: int, prompt: int = 0, scatter_seed: int | None = None
) -> dict[str, float]:
    """Steps of one request at each of `contexts` (engine_vs_hf's decode_step setup): decodes
    (a token at each context), or with `prompt` > 0 whole prompts of that many tokens (contexts 0).
    Each request's blocks follow one another in the cache, or, with `scatter_seed`, are drawn
    at random (that seed) from all of the cache's blocks."""
    from contbatch.core.outputs import ScheduledChunk, build_output
    from contbatch.engine.runner import SequenceState
    from contbatch.engine.sampling import SamplingParams

    bs = runner.kv_cache.block_size
    seqs, chunks, first_block = {}, [], 0
    new_tokens = max(prompt, 1)
    needed = sum(-(-(context + new_tokens) // bs) for context in contexts)
    order = list(range(needed))
    if scatter_seed is not None:
        order = random.Random(scatter_seed).sample(range(runner.kv_cache.num_blocks), needed)
    for i, context in enumerate(contexts):
        blocks = -(-(context + new_tokens) // bs)
        table = order[first_block : first_block + blocks]
        first_block += blocks
        seqs[f"d{i}"] = SequenceState([5] * (context + new_tokens), table, SamplingParams(temperature=0.0))
        chunks.append(ScheduledChunk(f"d{i}", context, new_tokens, prompt > 0, True))
    out = build_output(0, chunks)
    timer = ForwardTimer(runner.model)
    try:
        for _ in range(3):
            runner.execute(out, seqs)
        walls, cpus, forwards = [], [], []
        for _ in range(steps):
            timer.seconds = 0.0
            wall, cpu = time.perf_counter(), time.process_time()
            runner.execute(out, seqs)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            forwards.append(timer.seconds)
    finally:
        runner.model.forward = timer.inner
    step, forward = statistics.median(walls), statistics.median(forwards)
    return {
        "step_ms": 1000 * step,
        "step_cpu_ms": 1000 * statistics.median(cpus),
        "forward_ms": 1000 * forward,
        "host_fraction": 1 - sum(forwards) / sum(walls),
    }


@contextlib.contextmanager
def kernels_as_no_ops() -> Iterator[bool]:
    """Every native kernel a no-op (returning 0 at once; the queries of what the build runs kept)
    while the block runs: a step then costs what surrounds the kernels' arithmetic (Python,
    torch's dispatch and small tensors, ctypes, the runner's host work). Its outputs are garbage.
    Yields False (nothing replaced) where the kernels are off or this side's code has no
    `native_library`."""
    try:
        from contbatch.engine import native
    except ImportError:
        yield False
        return
    library_of = getattr(native, "native_library", None)
    real = library_of() if library_of is not None else None
    if real is None:
        yield False
        return
    queries = {"gemm_preferred", "argmax_bf16_kernels"}

    class NoOps:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name) if name in queries else (lambda *args: 0)

    no_ops = NoOps()
    native.native_library = lambda: no_ops
    try:
        yield True
    finally:
        native.native_library = library_of


@contextlib.contextmanager
def one_spinner() -> Iterator[None]:
    """Another process spinning on one core (pure Python, no I/O) while the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # (running before the first timed step)
        yield
    finally:
        spinner.kill()
        spinner.wait()


def beside_a_spinner(row: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`row` with `measure()` taken again while another process spins on a core, its ratios
    against `row`'s rooflines."""
    with one_spinner():
        shared = measure()
    for ratio, roofline in (("ratio", "roofline_ms"), ("ratio_mm", "roofline_mm_ms")):
        if roofline in row:
            shared[ratio] = shared["step_ms"] / row[roofline]
    return row | shared


def engine_steps(engine: Any, batch: int, context: int, steps: int, seed: int) -> dict[str, float]:
    """Full `LLMEngine.step()` calls, every one a decode of all `batch` requests."""
    from contbatch.engine.sampling import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    requests = [engine.add_request([rng.randrange(3, 32_000) for _ in range(context)], params) for _ in range(batch)]
    while any(r.num_output_tokens == 0 for r in requests):  # prefill (chunked over several steps)
        engine.step()
    for _ in range(3):
        engine.step()
    timer = ForwardTimer(engine.runner.model)
    try:
        walls, cpus, forwards = [], [], []
        for _ in range(steps):
            timer.seconds = 0.0
            wall, cpu = time.perf_counter(), time.process_time()
            engine.step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            forwards.append(timer.seconds)
    finally:
        engine.runner.model.forward = timer.inner
    if timer.tokens != [batch] * steps:
        raise RuntimeError(f"a timed engine step was not a decode of {batch} requests: tokens {timer.tokens}")
    for r in requests:
        engine.abort(r.request_id)
    return {
        "step_ms": 1000 * statistics.median(walls),
        "step_cpu_ms": 1000 * statistics.median(cpus),
        "forward_ms": 1000 * statistics.median(forwards),
        "host_ms": 1000 * statistics.median(w - f for w, f in zip(walls, forwards, strict=True)),
        "host_fraction": 1 - sum(forwards) / sum(walls),
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import contbatch
    from contbatch.engine.llm_engine import EngineConfig, LLMEngine

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_vs_hf import matmul_flops, roofline_bytes, roofline_ms, stream_bandwidth

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(kv_cache_memory=512 * 1024**2))
    runner = engine.runner
    total, multiplied = count_params(runner.model)
    result: dict[str, Any] = {"source": str(Path(contbatch.__file__).parent), "params": total}
    head = getattr(runner.model, "argmax_head", None)  # (the greedy argmax's kernel: before "tiles", "vectors" only)
    result["argmax_head"] = "float32" if head is None else getattr(head, "kernel", "vectors")
    result["params_multiplied"] = multiplied
    peak = statistics.median(matmul_flops() for _ in range(3))
    read = roofline_bytes(runner.spec, total, max(args.batches), args.context)  # the largest decode step's
    bandwidth = statistics.median(stream_bandwidth(read) for _ in range(3))
    result |= {"gflops": peak / 1e9, "bandwidth_gbs": bandwidth / 1e9}
    shapes = {f"decode_{b}": [args.context] * b for b in args.batches}
    shapes |= {f"decode_{b}_mixed": mixed_contexts(b, args.context) for b in args.batches if b > 1 and args.mixed}
    scattered = {f"decode_{b}_scattered": [args.context] * b for b in args.batches if b > 1 and args.scattered}
    shapes |= scattered
    for name, contexts in shapes.items():
        row = runner_step(runner, contexts, args.steps, scatter_seed=args.seed if name in scattered else None)
        batch, mean = len(contexts), sum(contexts) / len(contexts)  # (the roofline is linear in the context)
        row["roofline_ms"] = roofline_ms(runner.spec, total, batch, mean, peak=peak, bandwidth=bandwidth)
        row["roofline_mm_ms"] = roofline_ms(runner.spec, multiplied, batch, mean, peak=peak, bandwidth=bandwidth)
        row["ratio"] = row["step_ms"] / row["roofline_ms"]
        row["ratio_mm"] = row["step_ms"] / row["roofline_mm_ms"]
        result[name] = row
        if args.shared and name == f"decode_{max(args.batches)}":
            result[f"{name}_shared"] = beside_a_spinner(row, lambda c=contexts: runner_step(runner, c, args.steps))
        if name in (f"decode_{b}" for b in args.batches):
            with kernels_as_no_ops() as replaced:
                if replaced:
                    row["without_kernels_ms"] = runner_step(runner, contexts, args.steps)["step_ms"]
    count, length = args.prefill
    if count > 0:
        prefill = lambda: runner_step(runner, [0] * count, max(3, args.steps // 4), prompt=length)  # noqa: E731
        row = prefill()
        row["roofline_ms"] = prefill_roofline_ms(runner.spec, multiplied, count, length, peak=peak)
        row["ratio"] = row["step_ms"] / row["roofline_ms"]
        result[f"prefill_{count}x{length}"] = row
        if args.shared:
            result[f"prefill_{count}x{length}_shared"] = beside_a_spinner(row, prefill)
    result[f"engine_{args.engine_batch}"] = engine_steps(engine, args.engine_batch, args.context, args.steps, args.seed)
    return result


def prefill_roofline_ms(spec: Any, multiplied: int, count: int, length: int, *, peak: float) -> float:
    """A step of `count` whole prompts of `length` tokens at the matmul peak: every layer weight
    multiplied by every token, the LM head by one row a prompt, causal attention (length^2 / 2
    query-key pairs a head, each a dot product and a weighted sum)."""
    head = spec.vocab_size * spec.hidden_size
    flops = 2 * (multiplied - head) * count * length + 2 * head * count
    flops += 2 * 2 * count * length * length // 2 * spec.num_layers * spec.num_heads * spec.head_dim
    return 1000 * flops / peak


# -- driver ---------------------------------------------------------------------------------------------


def wait_until_quiet(limit_s: float, threshold: float = 0.1) -> float:
    """Wait (at most `limit_s`) until the machine is idle for a second; the seconds waited."""
    start = time.monotonic()
    while busy_fraction() > threshold and time.monotonic() - start < limit_s:
        pass
    return time.monotonic() - start


def contended(result: dict[str, Any], batches: list[int], threads: int) -> bool:
    """A run shared its cores with another job: the largest batch's decode step used less process
    CPU time than 80 % of `threads` x its wall time (a thread that loses its core waits instead of
    working, so CPU time per wall second drops towards 1)."""
    row = result[f"decode_{max(batches)}"]
    return threads > 1 and row["step_cpu_ms"] < 0.8 * threads * row["step_ms"]


def run_worker(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One worker run after waiting for an idle machine; a contended one (see `contended`) is run
    again, up to --retries times (the discarded attempts are kept under `discarded`)."""
    discarded: list[dict[str, Any]] = []
    for _ in range(args.retries + 1):
        waited = wait_until_quiet(args.quiet_wait)
        result = run_worker_once(src, args)
        result["waited_s"] = waited
        if not contended(result, args.batches, args.threads):
            break
        discarded.append(result)
        print(f"  contended run discarded (decode 32: {result.get('decode_32')})", file=sys.stderr)
    result["discarded"] = discarded
    return result


def run_worker_once(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--worker", "--context", str(args.context), "--steps", str(args.steps)]
    cmd += ["--threads", str(args.threads), "--engine-batch", str(args.engine_batch), "--seed", str(args.seed)]
    cmd += ["--batches", *map(str, args.batches), "--mixed" if args.mixed else "--no-mixed"]
    cmd += ["--scattered" if args.scattered else "--no-scattered", "--shared" if args.shared else "--no-shared"]
    cmd += ["--prefill", "{}x{}".format(*args.prefill)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["source"]).resolve() != (src / "contbatch").resolve():
        raise RuntimeError(f"worker imported contbatch from {result['source']}, not {src}")
    return result


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric, the median over the repetitions (nested dicts alike)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = medians([r[key] for r in runs])
        elif isinstance(value, list):
            continue  # discarded attempts: kept in `runs` only
        elif isinstance(value, int | float):
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = value
    return out


def report(sides: dict[str, dict[str, Any]], args: argparse.Namespace) -> tuple[list[list[str]], dict[str, Any]]:
    base, cur = sides["baseline"], sides["current"]
    rows = [["measure", "baseline", "current", "baseline/current"]]
    summary: dict[str, Any] = {}

    def add(name: str, b: float, c: float, fmt: str = "{:.2f}") -> None:
        rows.append([name, fmt.format(b), fmt.format(c), f"{b / c:.2f}x"])
        summary[name] = {"baseline": b, "current": c, "baseline_over_current": b / c}

    for key in (k for k in cur if k.startswith("prefill_")):
        b, c, name = base[key], cur[key], key.removeprefix("prefill_").replace("_", " ")
        add(f"prefill {name}: step ms", b["step_ms"], c["step_ms"])
        add(f"prefill {name}: step / roofline", b["ratio"], c["ratio"])
    for key in (k for k in cur if k.startswith("decode_")):
        b, c, name = base[key], cur[key], key.removeprefix("decode_").replace("_", " ")
        add(f"decode {name}: step ms", b["step_ms"], c["step_ms"])
        add(f"decode {name}: step CPU ms", b["step_cpu_ms"], c["step_cpu_ms"])
        add(f"decode {name}: forward ms", b["forward_ms"], c["forward_ms"])
        add(f"decode {name}: step / roofline", b["ratio"], c["ratio"])
        add(f"decode {name}: step / roofline_mm", b["ratio_mm"], c["ratio_mm"])
        add(f"decode {name}: roofline ms", b["roofline_ms"], c["roofline_ms"])
        add(f"decode {name}: host fraction", b["host_fraction"], c["host_fraction"], "{:.3f}")
        if "without_kernels_ms" in b and "without_kernels_ms" in c:
            add(f"decode {name}: step ms, kernels no-ops", b["without_kernels_ms"], c["without_kernels_ms"])
    b, c = base[f"engine_{args.engine_batch}"], cur[f"engine_{args.engine_batch}"]
    add(f"engine {args.engine_batch}: step ms", b["step_ms"], c["step_ms"])
    add(f"engine {args.engine_batch}: host ms", b["host_ms"], c["host_ms"])
    add(f"engine {args.engine_batch}: host fraction", b["host_fraction"], c["host_fraction"], "{:.3f}")
    return rows, summary


def _count_x_length(text: str) -> tuple[int, int]:
    count, _, length = text.partition("x")
    try:
        return int(count), int(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected COUNTxLENGTH such as 7x290, got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="81bb433", help="the commit compared against")
    parser.add_argument("--reps", type=int, default=3, help="worker runs per side (median reported)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument(
        "--mixed", action=argparse.BooleanOptionalAction, default=True,
        help="also each batch (> 1) with contexts spread over [context / 2, 2 context] (`mixed_contexts`)",
    )  # fmt: skip
    parser.add_argument(
        "--scattered", action=argparse.BooleanOptionalAction, default=True,
        help="also each batch (> 1) with every request's blocks drawn at random from the whole cache "
        "(as a server's are once requests have come and gone) instead of one after another",
    )  # fmt: skip
    parser.add_argument(
        "--shared", action=argparse.BooleanOptionalAction, default=True,
        help="also the largest batch's decode step and the prefill step while another process spins on a core",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (median)")
    parser.add_argument(
        "--prefill", type=_count_x_length, default=(7, 290), metavar="COUNTxLENGTH",
        help="also a prefill-only step of COUNT prompts of LENGTH tokens (default 7x290: 2,030 tokens, "
        "the peers' 2,048-token budget; 0x0: none), a quarter as many timed steps",
    )  # fmt: skip
    parser.add_argument("--engine-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retries", type=int, default=3, help="reruns of a contended worker run")
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="seconds to wait for an idle machine")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "engine_step.json"))
    args = parse_or_work(parser, worker)
    if args is None:
        return
    runs = alternating(args.baseline, args.reps, lambda src, _: run_worker(src, args))
    sides = {side: medians(r) for side, r in runs.items()}
    rows, summary = report(sides, args)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]))
    print(f"machine: {sides['current']['gflops']:.0f} GFLOP/s, {sides['current']['bandwidth_gbs']:.1f} GB/s (medians)")
    heads = {side: sides[side].get("argmax_head", "float32") for side in ("baseline", "current")}
    print(f"greedy steps' LM head: baseline {heads['baseline']}, current {heads['current']}")
    dropped = {side: sum(len(r["discarded"]) for r in rs) for side, rs in runs.items()}
    print(f"runs per side: {args.reps}; contended runs discarded and rerun: {dropped}")
    doc = {"args": vars(args), "summary": summary, "medians": sides, "runs": runs}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
