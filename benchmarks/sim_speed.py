"""Simulator speed, each workload side by side with its baseline in one script run.

Workloads (`WORKLOADS`; issue 19's table):
  (a)       10,000 requests, Poisson 10.5 req/s, 512 prompt and 128 output tokens each, a vLLM-like
            configuration (max 128 sequences, 4,096-token budget, paged KV), under the Llama-2-7B
            on A100 roofline preset, every token timestamp kept; baselines: BLIS (its fastest
            mode) and the code of --baseline;
  (a-100k)  the same with 100,000 requests; baseline: BLIS;
  (a-no-skip) (a) with skip-ahead off (the decode runs' own speed-up);
  (b)       the azure-code trace tiled in time to --requests-b requests (copies back to back,
            arrival gaps kept), `engine` preset, streaming mode, with its peak memory;
  (c)       azure-code at 4 times its rate, roofline Llama-2-7B on A100, `engine` preset:
            saturated, KV near full, preemptions;
  (c-swap)  (c) with preemption by swap to a host pool of 512 blocks (4 GiB of Llama-2-7B KV,
            vLLM's default swap space; when it is full a victim is recomputed);
  (d)       one request of 1,000,000 output tokens under the seed preset and `unit:8`;
  (a-vllm), (c-vllm) (a) and (c) under the `vllm` preset (prefix caching on; (a) with its 128
            sequences and 4,096-token budget);
  (a-cli)   (a) as a user runs it, and as BLIS's figure is taken: the whole `contbatch simulate`
            process (its command line, the trace read from a JSONL file the script writes
            first, the text report); baselines: BLIS and the command line of --baseline.

Each measurement is a fresh process (so peak memory and CPU time are its own), its modules loaded
from bytecode compiled before the first (as an installed package has it; both source trees). Reported per
workload: `sim_s` (the simulation's wall time), `summary_s` (every metric of the result),
`cpu_s` (the whole process's user + system CPU time: interpreter start, imports, trace,
simulation, summary: what BLIS's figure is) and peak RSS. With --baseline REF each workload also
runs on the simulator as it was at git commit REF (exported to a temporary folder and imported
from there; workloads it cannot run are left out), interleaved: as Python sources, or with
--baseline-compiled with that commit's compiled core built there first; with BLIS installed
(`../shared/anchors/blis/build.sh`; --blis PATH, default ~/.cache/contbatch-anchors/blis/blis)
(a) and (a-100k) also run in BLIS with `--cache-signal-delay 0`. `baseline_speedup` is the
baseline's whole-process CPU time over ours, `baseline_sim_speedup` and `baseline_summary_speedup`
the same for `sim_s` and `summary_s` alone (BLIS: `blis_speedup`). Ratios are medians over paired
repetitions (absolute rates differ about 2x between machines of one kind; ratios in one run do
not). Prints one table; writes JSON (--json-out).

    .venv/bin/python benchmarks/sim_speed.py --reps 3 --baseline 21f510d
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers
from baseline_src import build_compiled, export_src, side_env

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = ROOT.parent / "shared" / "anchors" / "blis"
DEFAULT_BLIS = Path.home() / ".cache" / "contbatch-anchors" / "blis" / "blis"


def _trace_a(n: int) -> Any:
    from contbatch.traces.synthetic import fixed, generate, poisson

    return generate("speed-a", n, poisson(10.5), fixed(512), fixed(128), seed=1)


def _azure_tiled(n: int) -> Any:
    from contbatch.traces import Trace, load_trace

    base = load_trace("azure-code")
    period = base.requests[-1].arrival_ts + (base.requests[-1].arrival_ts / (len(base) - 1))
    requests: list[Any] = []
    copy = 0
    while len(requests) < n:
        for r in base.requests:
            if len(requests) == n:
                break
            requests.append(
                dataclasses.replace(r, request_id=f"{copy}-{r.request_id}", arrival_ts=r.arrival_ts + copy * period)
            )
        copy += 1
    return Trace("azure-code-x", tuple(requests), "s", f"azure-code tiled to {n} requests")


def _azure_4x(_: int) -> Any:
    from contbatch.traces import load_trace
    from contbatch.traces.synthetic import scale_to_rate

    base = load_trace("azure-code")
    return scale_to_rate(base, 4 * len(base) / base.requests[-1].arrival_ts)


def _one_long(_: int) -> Any:
    from contbatch.traces import Trace, TraceRequest

    return Trace("one-long", (TraceRequest("long", 0.0, 4, 1_000_000),), "tick", "one request, 1,000,000 outputs")


@dataclasses.dataclass(frozen=True)
class Workload:
    trace: Callable[[int], Any]  # (requests for the sized ones) -> Trace
    size: int
    cost: str
    preset: str  # "a" (vLLM-like), "a-vllm", "engine", "engine-swap", "vllm" or "seed"
    skip_ahead: bool = True
    streaming: bool = False
    blis_requests: int | None = None  # run in BLIS too, with this many requests
    cli: bool = False  # run as `contbatch simulate` on the trace written to a file (the preset "a" only)


WORKLOADS: dict[str, Workload] = {
    "a": Workload(_trace_a, 10_000, "roofline:llama-2-7b@a100", "a", blis_requests=10_000),
    "a-100k": Workload(_trace_a, 100_000, "roofline:llama-2-7b@a100", "a", blis_requests=100_000),
    "a-no-skip": Workload(_trace_a, 10_000, "roofline:llama-2-7b@a100", "a", skip_ahead=False),
    "b": Workload(_azure_tiled, 1_000_000, "roofline:llama-2-7b@a100", "engine", streaming=True),
    "c": Workload(_azure_4x, 0, "roofline:llama-2-7b@a100", "engine"),
    "c-swap": Workload(_azure_4x, 0, "roofline:llama-2-7b@a100", "engine-swap"),
    "d": Workload(_one_long, 0, "unit:8", "seed"),
    "a-vllm": Workload(_trace_a, 10_000, "roofline:llama-2-7b@a100", "a-vllm"),
    "c-vllm": Workload(_azure_4x, 0, "roofline:llama-2-7b@a100", "vllm"),
    "a-cli": Workload(_trace_a, 10_000, "roofline:llama-2-7b@a100", "a", blis_requests=10_000, cli=True),
}
# `contbatch simulate` runs the preset "a" as the engine preset with these fields set
CLI_SETTINGS = ("--preset", "engine", "--set", "max_num_seqs=128", "--set", "max_num_batched_tokens=4096")


def run_one(name: str, size: int) -> dict[str, float]:
    """Run workload `name` in this process (imports included in its CPU time)."""
    from contbatch.core import PRESETS, ContinuousScheduler, seed_config
    from contbatch.sim import parse_cost, simulate

    w = WORKLOADS[name]
    trace = w.trace(size)
    config = {
        "a": dataclasses.replace(PRESETS["engine"], max_num_seqs=128, max_num_batched_tokens=4096),
        "engine": PRESETS["engine"],
        "engine-swap": dataclasses.replace(
            PRESETS["engine"], kv=dataclasses.replace(PRESETS["engine"].kv, preemption="swap", num_host_blocks=512)
        ),
        "seed": seed_config(),
        "a-vllm": dataclasses.replace(PRESETS["vllm"], max_num_seqs=128, max_num_batched_tokens=4096),
        "vllm": PRESETS["vllm"],
    }[w.preset]
    start = time.perf_counter()
    result = simulate(
        trace, ContinuousScheduler(config), parse_cost(w.cost), skip_ahead=w.skip_ahead, keep_timelines=not w.streaming
    )
    simulated = time.perf_counter()
    summary = result.summary()
    summarized = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "requests": len(trace),
        "steps": result.num_steps,
        "sim_s": simulated - start,
        "summary_s": summarized - simulated,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "requests_per_s": len(trace) / (simulated - start),
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "completed": float(summary["completed"]),  # type: ignore[arg-type]
    }


def _compile_bytecode(*trees: Path | None) -> None:
    """Compile each source tree's modules to bytecode (`__pycache__`) before any measurement, as
    an installed package has them: a child then loads them, even where PYTHONDONTWRITEBYTECODE
    is set (as in this project's sandbox, where each child would otherwise compile every module
    from source: about 0.1-0.15 CPU-s of a run)."""
    import compileall

    for tree in trees:
        if tree is not None:
            compileall.compile_dir(tree, quiet=1)


def _in_process(name: str, size: int, src: Path | None) -> dict[str, float]:
    import subprocess

    cmd = [sys.executable, __file__, "--only", name, "--size", str(size)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=side_env(src)).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _child(cmd: list[str], requests: int, **popen: Any) -> dict[str, float]:
    """One run of the command `cmd`, its output discarded: its own CPU time, wall time and peak
    RSS (`os.wait4`'s usage of that child alone). SystemExit when it cannot start;
    `CalledProcessError` (with its stderr) when it fails, as `_in_process` raises it."""
    import subprocess
    import tempfile

    with tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        try:
            child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, **popen)
        except OSError as exc:
            raise SystemExit(f"{cmd[0]} could not start: {exc}") from None
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait again)
        if child.returncode:
            stderr.seek(0)
            raise subprocess.CalledProcessError(child.returncode, cmd, stderr=stderr.read().decode(errors="replace"))
    cpu = usage.ru_utime + usage.ru_stime
    return {"requests": requests, "cpu_s": cpu, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def _blis(blis: Path, num_requests: int, tmp: Path) -> dict[str, float]:
    spec = (ANCHOR / "workload_a.yaml").read_text().replace("num_requests: 10000", f"num_requests: {num_requests}")
    spec_path = tmp / f"workload_a_{num_requests}.yaml"
    spec_path.write_text(spec)
    cmd = [str(blis), "run", "--model", "meta-llama/llama-2-7b-hf", "--latency-model", "roofline",
           "--hardware", "A100-80", "--tp", "1", "--max-num-seqs", "128", "--max-num-batched-tokens", "4096",
           "--num-instances", "1", "--workload-spec", str(spec_path), "--cache-signal-delay", "0"]  # fmt: skip
    return _child(cmd, num_requests, cwd=blis.parent / "src")


def _cli(w: Workload, trace_file: Path, src: Path | None) -> dict[str, float]:
    """`contbatch simulate` on `trace_file`, from this checkout (`src` None) or from `src`."""
    cmd = [sys.executable, "-c", "import sys; from contbatch.cli.main import main; sys.exit(main())", "simulate",
           "--trace", str(trace_file), "--cost", w.cost, *CLI_SETTINGS]  # fmt: skip
    return _child(cmd, w.size, env=side_env(src))


def _write_trace(name: str, tmp: Path) -> Path:
    from contbatch.traces import write_jsonl

    w = WORKLOADS[name]
    path = tmp / f"{name}.jsonl"
    write_jsonl(w.trace(w.size), path)
    return path


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--workloads", default="a,a-100k,a-no-skip,a-cli,b,c,d", help="comma-separated, of " + ", ".join(WORKLOADS)
    )
    parser.add_argument("--requests-b", type=int, default=WORKLOADS["b"].size)
    parser.add_argument("--baseline", metavar="REF", help="also run each workload on the code of this git commit")
    parser.add_argument(
        "--baseline-compiled",
        action="store_true",
        help="build the baseline commit's compiled core and run it (a commit that has one)",
    )
    parser.add_argument("--blis", type=Path, default=DEFAULT_BLIS, help="the BLIS binary (skipped when absent)")
    parser.add_argument("--only", choices=sorted(WORKLOADS), help="run one workload in this process (internal)")
    parser.add_argument("--size", type=int, default=0, help="(internal) the workload's size")
    parser.add_argument("--json-out", default="sim_speed.json")
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run_one(args.only, args.size)))
        return
    _compare(parser, args)


def _baseline(args: argparse.Namespace, tmp: Path) -> tuple[Path | None, str | None]:
    """The exported `src` of --baseline (None without one) and which core it runs, in words."""
    if not args.baseline:
        return None, None
    src = export_src(args.baseline, tmp)
    return src, build_compiled(src) if args.baseline_compiled else "pure Python (its sources, no build)"


def _compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every workload, ours and its baselines, in fresh processes; the table and the JSON. (The
    modules only this parent needs are imported here: a measured child does not pay for them.)"""
    import functools
    import platform
    import subprocess
    import tempfile

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    blis = args.blis if args.blis.exists() else None
    if blis is None:
        print(
            f"BLIS not found at {args.blis}: its column stays empty (../shared/anchors/blis/build.sh)", file=sys.stderr
        )
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        n: {"contbatch": [], "baseline": [], "blis": []} for n in names
    }
    with tempfile.TemporaryDirectory() as tmp:
        src, baseline_core = _baseline(args, Path(tmp))
        _compile_bytecode(ROOT / "src", src)
        trace_files = {name: _write_trace(name, Path(tmp)) for name in names if WORKLOADS[name].cli}
        for rep in range(args.reps):
            for name in names:
                w = WORKLOADS[name]
                size = args.requests_b if name == "b" else w.size
                if w.cli:
                    measure = functools.partial(_cli, w, trace_files[name])
                else:
                    measure = functools.partial(_in_process, name, size)
                runs[name]["contbatch"].append(measure(None))
                if src is not None:
                    try:
                        runs[name]["baseline"].append(measure(src))
                    except subprocess.CalledProcessError as exc:  # the old code lacks what it needs
                        print(
                            f"{name} on {args.baseline} failed: {exc.stderr.strip().splitlines()[-1:]}", file=sys.stderr
                        )
                if blis is not None and w.blis_requests is not None:
                    runs[name]["blis"].append(_blis(blis, w.blis_requests, Path(tmp)))
                print(f"rep {rep + 1}/{args.reps} {name} done", file=sys.stderr, flush=True)
    from contbatch import compiled  # which core this checkout's side ran (contbatch.compiled)

    table = {name: _row(r) for name, r in runs.items()}
    _print(table, args.baseline)
    print(f"core: {compiled.describe()}")
    print(f"baseline core: {baseline_core}")
    machine = {"python": platform.python_version(), "machine": platform.machine(), "core": compiled.describe()}
    machine["baseline_core"] = baseline_core
    doc = {**machine, "args": vars(args) | {"blis": str(args.blis)}, "table": table, "runs": runs}
    Path(args.json_out).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def _row(r: dict[str, list[dict[str, float]]]) -> dict[str, float | None]:
    import statistics

    ours = r["contbatch"]
    row: dict[str, float | None] = {k: statistics.median(x[k] for x in ours) for k in ours[0]}
    for other in ("baseline", "blis"):
        theirs = r[other][: len(ours)]
        row[f"{other}_cpu_s"] = statistics.median(x["cpu_s"] for x in theirs) if theirs else None
        pairs = list(zip(ours, theirs, strict=False))
        # paired ratios of whole-process CPU time (the baseline's over ours: > 1 means we are faster)
        row[f"{other}_speedup"] = statistics.median(t["cpu_s"] / o["cpu_s"] for o, t in pairs) if pairs else None
    base = r["baseline"][: len(ours)]
    pairs = list(zip(ours, base, strict=False))
    for part in ("sim", "summary"):  # the simulation alone, the summary alone (not timed in a command-line run)
        key = f"{part}_s"
        timed = pairs and key in ours[0]
        row[f"baseline_{part}_speedup"] = statistics.median(t[key] / o[key] for o, t in pairs) if timed else None
    return row


def _print(table: dict[str, dict[str, float | None]], baseline: str | None) -> None:
    cols = ["requests", "steps", "sim_s", "summary_s", "cpu_s", "peak_rss_mb", "baseline_cpu_s",
            "baseline_sim_speedup", "baseline_summary_speedup", "baseline_speedup", "blis_cpu_s",
            "blis_speedup"]  # fmt: skip
    rows = [["workload", *cols]] + [[n, *(_fmt(t.get(c)) for c in cols)] for n, t in table.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols) + 1)]
    print("\n".join("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows))
    print(
        f"baseline: {baseline or '-'}; *_speedup = their whole-process CPU time (sim_, summary_: their"
        " simulation, their summary wall time) / ours, medians of paired runs"
    )


if __name__ == "__main__":
    main()
