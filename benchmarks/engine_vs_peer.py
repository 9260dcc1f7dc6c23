"""The engine against its peers over HTTP: tokens/s, p50 TTFT and TPOT, one table (issue 19, engine row 3).

    flock /tmp/contbatch-bench.lock .venv/bin/python benchmarks/engine_vs_peer.py [--reps 3] [--quick]

Servers, each started here on 127.0.0.1 as a child process (`contbatch.bench.servers`), on the
demo checkpoint (`contbatch.engine.demo.ensure_demo_model`, float32, CPU, ``--threads`` threads
through OMP/MKL_NUM_THREADS; ``--device cuda`` puts contbatch and transformers serve on a GPU):

- ``contbatch``: `contbatch serve --backend engine --kv-cache-memory MIB --set
  max_num_batched_tokens=BUDGET`, MIB being ``--kv-tokens`` tokens of KV, and the serving flags of
  ``--contbatch-flags`` (default: ``--set queue_order=shortest --set defer_partial_prefills=true
  --gather-gap 0.01``: shortest prompt first, no new split prefill in a step that already yields a
  first token, and an idle engine's first step waiting for the rest of a burst; see
  docs/server.md);
- ``transformers``: `transformers serve --continuous-batching --cb-block-size 256 --cb-num-blocks
  KV_TOKENS/256 --cb-max-batch-tokens BUDGET`: the same KV capacity in tokens and the same token
  budget per step (skipped when transformers cannot serve here);
- ``llama.cpp``: `llama-server -np 48 -cb -c 24576 -t THREADS` on the GGUF that
  ../shared/anchors/llamacpp/build.sh makes (``--llama-server``, ``--gguf``), only when both
  exist; requests then carry ``cache_prompt: false``. Its 48 slots have 512 tokens each, so it
  runs only the workloads whose requests fit a slot.
- ``baseline`` (with ``--baseline REV``): the ``contbatch`` server as commit REV had it (its
  ``src`` exported by `git archive` into ``--work-dir`` and put first on the server's
  PYTHONPATH), with the same flags but ``--contbatch-flags``': ``--baseline-flags`` (default
  none: the server's defaults; give ``--contbatch-flags``' own to isolate the code's change): an
  engine change measured against the code before it, side by side in one run (the peers' speed
  drifts with the machine between runs).

Workloads (each a trace file in ``--work-dir``, sent by `contbatch bench --trace`, in this
process, plain OpenAI requests with temperature 0 to every server alike: transformers serve
refuses ``ignore_eos``, so an output may stop early at EOS; the table shows the tokens received):

1. ``poisson``: 48 requests, prompts uniform in 128-384 tokens, 128 output tokens, Poisson 4/s;
2. ``burst``: the same 48 requests (lengths), all at once;
3. ``long``: 16 requests, prompts of 1,024 tokens, 64 output tokens, Poisson 2/s.

Prompt lengths are in the model's tokens: `contbatch bench` builds a prompt of N short words, and
the demo tokenizer is byte-level (about 1.3 tokens a word), so each request's word count is the
one whose prompt encodes closest to its length. Each workload has its own seed (its own words):
a prefix cache never serves one workload from another's prompts; every server is restarted for
each repetition, so none serves a repetition from the one before.

Order: per repetition, one server at a time (started, warmed up with a short all-at-once run,
the three workloads, stopped) so two servers never share the CPU; the servers' order alternates
between repetitions. Each cell of the table is the median over ``--reps`` repetitions; a ratio
is of those medians. Targets (the issue's): against transformers serve, output tokens/s at least
4x on ``burst`` and 3x on ``poisson``, p50 TTFT at most 0.2x theirs (every workload); against
llama.cpp, output tokens/s at least 1x and p50 TTFT at most 1x on ``burst`` and ``poisson``.

Beside each cell: the CPUs the server used during the run (least over the repetitions) and those
everything else on the machine used (``others``, most; this client's own left out, from
/proc/stat): above about 0.2, another job shared the cores and the cell measures that job too.
Under a paced workload's rows: the tokens/s its arrivals allow any server (every planned output
token by the last arrival, `arrival_ceiling`) and so the highest tokens/s ratio a server could
reach against each peer in that run: the Poisson workload's last request arrives at 10.71 s, so
its ratio against a peer is bounded by the peer's speed, whatever contbatch does.

Prints the table and writes everything (configuration, every run, medians, ratios) to
``benchmarks/results/engine_vs_peer.json`` (``--json-out``). ``--quick``: 12/12/4 requests with
shorter outputs and one repetition, a smoke test of about a minute (not a measurement).

``--across RUN.json ...`` starts no server: it prints each target over those runs (each run's
ratio of medians, how many runs met it, the spread of the repetitions' pairs and, for a paced
workload's tokens/s, the highest ratio its arrivals allowed in each run), the
distribution that one run's medians hide on a shared machine, and writes it to ``--json-out``
(default ``benchmarks/results/engine_vs_peer_across.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers
from baseline_src import export_src
from machine_load import cpu_ticks as machine_ticks

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SERVERS = ("contbatch", "baseline", "transformers", "llama.cpp")
PEERS = ("baseline", "transformers", "llama.cpp")
PEER_BLOCK = 256  # transformers serve's KV block (its default page size)
# the contbatch server's serving choices
CONTBATCH_FLAGS = "--set queue_order=shortest --set defer_partial_prefills=true --gather-gap 0.01"
LLAMA_SLOTS, LLAMA_CTX = 48, 24576
LLAMA_DIR = Path(os.environ.get("ANCHOR_DIR", Path.home() / ".cache" / "contbatch-anchors" / "llamacpp"))
LLAMA_MISSING = "llama.cpp: not built (../shared/anchors/llamacpp/build.sh)"
KEEP = ("completed", "failed", "duration", "output_throughput", "request_throughput", "median_ttft_ms",
        "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "total_input_tokens",
        "total_output_tokens")  # fmt: skip
# (workload, peer) -> (key, bound, "min" (ours / theirs >= bound) or "max" (ours / theirs <= bound))
TARGETS: dict[tuple[str, str], list[tuple[str, float, str]]] = {
    ("poisson", "transformers"): [("output_throughput", 3.0, "min"), ("median_ttft_ms", 0.2, "max")],
    ("burst", "transformers"): [("output_throughput", 4.0, "min"), ("median_ttft_ms", 0.2, "max")],
    ("long", "transformers"): [("median_ttft_ms", 0.2, "max")],
    ("poisson", "llama.cpp"): [("output_throughput", 1.0, "min"), ("median_ttft_ms", 1.0, "max")],
    ("burst", "llama.cpp"): [("output_throughput", 1.0, "min"), ("median_ttft_ms", 1.0, "max")],
}


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    prompt: tuple[int, int]  # tokens, uniform in [lo, hi]
    output: int
    rate: float  # requests/s; inf: all at once
    seed: int  # the trace's draws and the prompts' words
    same_as: str | None = None  # the same requests (lengths, arrivals) as this workload, sent at `rate`

    @property
    def label(self) -> str:
        rate = "all at once" if self.rate == float("inf") else f"Poisson {self.rate:g}/s"
        lo, hi = self.prompt
        prompt = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return f"{self.name}: {self.requests} req, prompts {prompt}, out {self.output}, {rate}"


def workloads(quick: bool) -> list[Workload]:
    n, out, long_n, long_out = (12, 32, 4, 16) if quick else (48, 128, 16, 64)
    return [
        Workload("poisson", n, (128, 384), out, 4.0, seed=1),
        Workload("burst", n, (128, 384), out, float("inf"), seed=2, same_as="poisson"),
        Workload("long", long_n, (1024, 1024), long_out, 2.0, seed=3),
    ]


# -- traces ---------------------------------------------------------------------------------------


def words_for_tokens(tokens: int, count: Callable[[int], int]) -> int:
    """The word count n >= 1 whose prompt encodes closest to `tokens` (`count(n)`: tokens of n words,
    non-decreasing in n: a prompt of n words is the first n of n + 1)."""
    lo, hi = 1, max(2, tokens)
    while count(hi) < tokens:
        hi *= 2
    while lo < hi:  # the least n with count(n) >= tokens
        mid = (lo + hi) // 2
        if count(mid) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    if lo > 1 and tokens - count(lo - 1) < count(lo) - tokens:
        return lo - 1
    return lo


def write_traces(items: list[Workload], model: Path, work: Path) -> dict[str, dict[str, Any]]:
    """One trace file per workload, prompt lengths in words (see the module's doc); what was written."""
    import dataclasses

    from tokenizers import Tokenizer

    from contbatch.bench.workload import prompt_text
    from contbatch.traces import synthetic as synth
    from contbatch.traces.jsonl import write_jsonl

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    written: dict[str, dict[str, Any]] = {}
    lengths: dict[str, Any] = {}
    for w in items:
        if w.same_as is None:
            rate = 1.0 if w.rate == float("inf") else w.rate
            lo, hi = w.prompt
            prompts = synth.fixed(lo) if lo == hi else synth.uniform(lo, hi)
            trace = synth.generate(w.name, w.requests, synth.poisson(rate), prompts, synth.fixed(w.output), seed=w.seed)
            lengths[w.name] = trace
        else:
            trace = dataclasses.replace(lengths[w.same_as], name=w.name)
        requests, tokens = [], []
        for r in trace.requests:

            def count(n: int, rid: str = r.request_id, seed: int = w.seed) -> int:
                return len(tokenizer.encode(prompt_text(n, seed, rid)).ids)

            words = words_for_tokens(r.num_prompt_tokens, count)
            requests.append(dataclasses.replace(r, num_prompt_tokens=words))
            tokens.append(count(words))
        path = work / f"{w.name}.jsonl"
        write_jsonl(dataclasses.replace(trace, requests=tuple(requests)), path)
        written[w.name] = {"trace": str(path), "prompt_tokens": tokens, "prompt_words": [r.num_prompt_tokens
                           for r in requests], "arrivals_s": [r.arrival_ts for r in trace.requests]}  # fmt: skip
    return written


# -- servers --------------------------------------------------------------------------------------


@dataclass
class Setup:
    model: Path
    kv_tokens: int
    kv_mib: int
    budget: int
    threads: int
    llama_server: Path
    gguf: Path
    work: Path
    baseline_src: Path | None = None  # the baseline commit's exported src (--baseline)
    contbatch_flags: tuple[str, ...] = ()  # the `contbatch` server's serving flags
    baseline_flags: tuple[str, ...] = ()  # the `baseline` server's
    device: str = "cpu"  # contbatch's and transformers serve's (llama.cpp runs on the CPU)


def kv_mib_for(kv_tokens: int, bytes_per_token: int) -> int:
    size = kv_tokens * bytes_per_token
    if size % 2**20:
        raise SystemExit(f"--kv-tokens {kv_tokens}: {size} bytes of KV is not a whole number of MiB; choose another")
    return size // 2**20


def export_baseline(commit: str, work: Path) -> Path:
    """`export_src` of COMMIT under `work`, checked to be what a server started with it on
    PYTHONPATH imports contbatch from. SystemExit with the reason when it cannot be."""
    import shutil
    import subprocess

    into = work / f"baseline-{commit}"
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    src = export_src(commit, into)
    probe = subprocess.run([sys.executable, "-c", "import contbatch; print(contbatch.__file__)"], text=True,
                           capture_output=True, env={**os.environ, "PYTHONPATH": str(src)}, check=False)  # fmt: skip
    found = Path(probe.stdout.strip()).resolve().parent if probe.returncode == 0 else None
    if found != (src / "contbatch").resolve():
        raise SystemExit(f"--baseline {commit}: contbatch imports from {found}, not {src / 'contbatch'}")
    return src


def llama_missing(setup: Setup) -> str | None:
    if not setup.llama_server.is_file():
        return f"{LLAMA_MISSING}: no {setup.llama_server}"
    if not setup.gguf.is_file():
        return f"llama.cpp: no GGUF model at {setup.gguf} (../shared/anchors/llamacpp/build.sh converts it)"
    return None


def server_argv(name: str, setup: Setup, port: int) -> list[str]:
    from contbatch.bench.servers import contbatch_argv, transformers_serve_argv

    model = str(setup.model)
    if name in ("contbatch", "baseline"):
        return contbatch_argv("serve", "--backend", "engine", "--model", model, "--served-model-name", model,
                              "--device", setup.device, "--dtype", "float32", "--kv-cache-memory", str(setup.kv_mib),
                              "--set", f"max_num_batched_tokens={setup.budget}",
                              *(setup.contbatch_flags if name == "contbatch" else setup.baseline_flags),
                              port=port)  # fmt: skip
    if name == "transformers":
        return transformers_serve_argv(
            model,
            port=port,
            num_blocks=setup.kv_tokens // PEER_BLOCK,
            max_batch_tokens=setup.budget,
            block_size=PEER_BLOCK,
            dtype="float32",
            device=setup.device,
        )
    return [str(setup.llama_server), "-m", str(setup.gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(LLAMA_SLOTS), "-cb", "-c", str(LLAMA_CTX), "-t", str(setup.threads)]  # fmt: skip


@contextlib.contextmanager
def serving(name: str, setup: Setup) -> Iterator[Any]:
    """Start `name`, yield it (a `ServerProcess`) once healthy; stopped when the block ends."""
    from contbatch.bench.servers import TRANSFORMERS_OFFLINE_ENV, free_port, running_server

    port = free_port()
    threads = str(setup.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           **TRANSFORMERS_OFFLINE_ENV}  # fmt: skip
    if name == "baseline" and setup.baseline_src is not None:
        env["PYTHONPATH"] = str(setup.baseline_src)
    log = setup.work / f"{name}.log"
    with running_server(server_argv(name, setup, port), port, env=env, log=log, start_s=300) as server:
        yield server


# -- bench ----------------------------------------------------------------------------------------


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(busy clock ticks of the whole machine, ticks of process `pid` and its live descendants, all
    their threads: a server may do its work in a child process, as `transformers serve` 5 does);
    (0, 0) off Linux."""
    try:
        busy, _ = machine_ticks()
    except (OSError, ValueError):
        return 0, 0
    return busy, tree_ticks(pid)


def tree_ticks(root: int) -> int:
    """utime + stime of process `root` and of its live descendants, from /proc (0 when it is gone)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # its parent's
        ticks[pid] = int(fields[11]) + int(fields[12])
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total


def bench(url: str, name: str, setup: Setup, flags: list[str], pid: int = 0) -> dict[str, Any]:
    """`contbatch bench --json` in this process against `url`; the summary's `KEEP` keys, and the CPUs the
    server (`pid`), this process (the client) and everything else on the machine used meanwhile."""
    from contbatch.cli.main import main

    argv = ["bench", "--base-url", url, "--model", str(setup.model), "--timeout", "600", "--disable-tqdm", "--json",
            *flags]  # fmt: skip
    if name == "llama.cpp":
        argv += ["--extra-body", '{"cache_prompt": false}']
    out = io.StringIO()
    machine0, server0 = cpu_ticks(pid or os.getpid())
    client0, wall0 = os.times(), time.monotonic()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    machine1, server1 = cpu_ticks(pid or os.getpid())
    client1, wall = os.times(), time.monotonic() - wall0
    if code not in (0, 1):  # 1: every request failed, the document says how
        raise RuntimeError(f"contbatch {' '.join(argv)} exited {code}")
    doc = json.loads(out.getvalue())
    result = {k: doc.get(k) for k in KEEP}
    result["errors"] = sorted({str(e) for e in doc.get("errors") or [] if e})[:3]
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    client = (client1.user + client1.system - client0.user - client0.system) / wall
    result["server_cpus"] = (server1 - server0) / tick / wall if pid else None
    result["client_cpus"] = client
    others = (machine1 - machine0) / tick / wall - client - (result["server_cpus"] or 0.0)
    result["other_cpus"] = max(0.0, others)  # ticks are counted apart: a quiet machine reads a little below 0
    return result


def fits_llama(w: Workload) -> bool:
    # 384 + 128 fills a 512-token slot exactly: one token more (a BOS) and llama.cpp ends that output
    # early, which the table's output tokens show
    return w.prompt[1] + w.output <= LLAMA_CTX // LLAMA_SLOTS


def one_server(name: str, setup: Setup, items: list[Workload], traces: dict[str, dict[str, Any]],
               quick: bool) -> dict[str, Any]:  # fmt: skip
    """Start `name`, warm it up, run every workload, stop it: {workload: result or {"error": ...}}."""
    from contbatch.bench.servers import ServerStartError

    runs: dict[str, Any] = {}
    started = time.monotonic()
    try:
        with serving(name, setup) as server:
            url, pid = server.url, server.process.pid
            up_s = time.monotonic() - started
            warm = ["--num-prompts", "4" if quick else "8", "--input-len", "200", "--output-len", "16", "--seed", "99"]
            bench(url, name, setup, ["--request-rate", "inf", *warm], pid)
            for w in items:
                if name == "llama.cpp" and not fits_llama(w):
                    runs[w.name] = {"error": f"skipped: a request exceeds a slot ({LLAMA_CTX // LLAMA_SLOTS} tokens)"}
                    continue
                flags = ["--trace", traces[w.name]["trace"], "--seed", str(w.seed)]
                if w.rate == float("inf"):
                    flags += ["--request-rate", "inf"]
                print(f"  {name} {w.name} ...", file=sys.stderr, flush=True)
                runs[w.name] = bench(url, name, setup, flags, pid)
    except (ServerStartError, RuntimeError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return {"error": str(exc)[-2000:]}
    runs["startup_s"] = up_s
    return runs


# -- results --------------------------------------------------------------------------------------


def medians(reps: list[dict[str, Any]], server: str, workload: str) -> dict[str, float | None] | None:
    """Per key of `KEEP`, the median over the repetitions in which `server` ran `workload`."""
    results = [rep[server][workload] for rep in reps
               if isinstance(rep.get(server, {}).get(workload), dict) and "error" not in rep[server][workload]
               and rep[server][workload].get("completed")]  # fmt: skip
    if not results:
        return None
    out: dict[str, float | None] = {
        k: float(statistics.median(r[k] for r in results)) for k in KEEP if all(r.get(k) is not None for r in results)
    }
    out["reps"] = float(len(results))
    # the noise beside a cell, its worst repetition's: the least CPU the server had, the most others took
    cpus = [r["server_cpus"] for r in results if r.get("server_cpus") is not None]
    others = [r["other_cpus"] for r in results if r.get("other_cpus") is not None]
    out["server_cpus_min"], out["other_cpus_max"] = min(cpus, default=None), max(others, default=None)
    return out


def ratios(ours: dict[str, Any] | None, theirs: dict[str, Any] | None, workload: str,
           peer: str) -> dict[str, Any] | None:  # fmt: skip
    """ours / theirs for tokens/s and p50 TTFT, and each target's bound and whether it is met."""
    if not ours or not theirs:
        return None
    values = {
        key: ours[key] / theirs[key] if theirs.get(key) else None for key in ("output_throughput", "median_ttft_ms")
    }
    targets = []
    for key, bound, kind in TARGETS.get((workload, peer), []):
        value = values[key]
        met = None if value is None else meets(value, bound, kind)
        targets.append({"metric": key, "bound": bound, "kind": kind, "ratio": value, "met": met})
    return {**values, "targets": targets}


def arrival_ceiling(arrivals_s: list[float], output_tokens: int) -> float | None:
    """The output tokens/s no server can exceed on a paced workload: every request's planned output
    over the time its last request arrives (a run lasts at least that long); None when every
    request arrives at once. A throughput ratio against a peer is at most this over the peer's."""
    last = max(arrivals_s, default=0.0)
    return len(arrivals_s) * output_tokens / last if last > 0 else None


def ceilings_of(workloads: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each paced workload's `arrival_ceiling`, from the workloads as a run's JSON lists them (an
    all-at-once workload has its `same_as` workload's arrivals, which it ignores: None)."""
    return {w["name"]: arrival_ceiling(w["arrivals_s"], w["output"]) if float(w["rate"]) != float("inf") else None
            for w in workloads}  # fmt: skip


def _ceiling_line(ceiling: float, medians: dict[str, Any]) -> str:
    tok_s = {s: m["output_throughput"] for s, m in medians.items() if m and m.get("output_throughput")}
    ours = f"; contbatch {tok_s['contbatch'] / ceiling:.0%} of it" if "contbatch" in tok_s else ""
    peers = ", ".join(f"{ceiling / tok_s[p]:.2f}x {p}" for p in PEERS if p in tok_s)
    most = f"; the most a ratio could be: {peers}" if peers else ""
    return f"  the arrivals cap every server at {ceiling:.0f} out tok/s{ours}{most}"


def meets(ratio: float, bound: float, kind: str) -> bool:
    """Whether `ratio` meets a target: at least `bound` ("min") or at most it ("max")."""
    return ratio >= bound if kind == "min" else ratio <= bound


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def _target_text(t: dict[str, Any]) -> str:
    sign = ">=" if t["kind"] == "min" else "<="
    verdict = "-" if t["met"] is None else ("met" if t["met"] else "MISSED")
    return f"target {sign} {t['bound']:g}x: {verdict}"


def _row(server: str, m: dict[str, Any], requests: int) -> str:
    done = f"{m.get('completed', 0):.0f}/{requests}"
    return (f"{server:<14}{_num(m.get('output_throughput'), '.1f'):>10}"
            f"{_num(m.get('median_ttft_ms'), '.2f', 1e-3):>12}{_num(m.get('mean_tpot_ms'), '.0f'):>9}"
            f"{done:>8}{_num(m.get('total_output_tokens'), '.0f'):>12}"
            f"{_num(m.get('server_cpus_min'), '.2f'):>13}{_num(m.get('other_cpus_max'), '.2f'):>8}")  # fmt: skip


def table(items: list[Workload], summary: dict[str, Any], notes: dict[str, str]) -> str:
    """The one table: per workload, a row per server and a ratio line per peer."""
    header = (f"{'server':<14}{'out tok/s':>10}{'p50 TTFT s':>12}{'TPOT ms':>9}{'done':>8}{'out tokens':>12}"
              f"{'server CPUs':>13}{'others':>8}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for w in items:
        lines.append(w.label)
        for server in SERVERS:
            m = summary["medians"][w.name].get(server)
            if m is None and server not in notes and not summary["problems"][w.name].get(server):
                continue  # not asked for
            if m is None:
                why = "not run (below)" if server in notes else summary["problems"][w.name].get(server, "")
                lines.append(f"{server:<14}{'-':>10}{'-':>12}{'-':>9}{'-':>8}{'-':>12}  {why}".rstrip())
                continue
            lines.append(_row(server, m, w.requests))
        if ceiling := summary.get("ceilings", {}).get(w.name):
            lines.append(_ceiling_line(ceiling, summary["medians"][w.name]))
        for peer in PEERS:
            r = summary["ratios"][w.name].get(peer)
            if r is None:
                continue
            tps, ttft = r["output_throughput"], r["median_ttft_ms"]
            by_key = {t["metric"]: f" ({_target_text(t)})" for t in r["targets"]}
            lines.append(f"  contbatch / {peer}: tok/s {_num(tps, '.2f')}x{by_key.get('output_throughput', '')}; "
                         f"p50 TTFT {_num(ttft, '.2f')}x{by_key.get('median_ttft_ms', '')}")  # fmt: skip
    lines.append(f"medians over {summary['reps']} repetition(s); ratios of the medians (contbatch / peer); TPOT: mean;")
    lines.append("CPUs used during the run (of the machine's): the server's (least over repetitions), everything "
                 "else's but this client (most): above ~0.2, another job shared the cores")  # fmt: skip
    lines.extend(note for note in notes.values() if note)
    lines.extend(f"{w}/{s}: {p}" for w, row in summary["problems"].items() for s, p in row.items() if s not in notes)
    return "\n".join(lines)


def summarize_reps(items: list[Workload], reps: list[dict[str, Any]],
                   ceilings: dict[str, float | None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Medians, ratios and problems per workload; `ceilings` (`ceilings_of`) carried for the table."""
    meds = {w.name: {s: medians(reps, s, w.name) for s in SERVERS} for w in items}
    rats = {w.name: {p: ratios(meds[w.name]["contbatch"], meds[w.name][p], w.name, p) for p in PEERS} for w in items}
    problems = {w.name: {s: p for s in SERVERS if (p := problem(reps, s, w.name))} for w in items}
    return {"reps": len(reps), "medians": meds, "ratios": rats, "problems": problems, "ceilings": ceilings or {}}


def across_runs(paths: list[Path]) -> tuple[str, dict[str, Any]]:
    """Each target over several runs' JSON files (`--across`): the ratio of each run's medians
    (what a run reports), how many runs met it, and the ratio of each repetition's pair (the
    contbatch run and the peer's run of the same repetition), to show the spread behind them."""
    docs = [_run_document(path) for path in paths]
    rows: list[dict[str, Any]] = []
    named = {(t["workload"], t["peer"], t["metric"], t["bound"], t["kind"]) for d in docs for t in d["targets"]}
    for workload, peer, metric, bound, kind in sorted(named):
        per_run = [(d["ratios"].get(workload, {}).get(peer) or {}).get(metric) for d in docs]
        pairs = [_pair_ratio(rep, workload, peer, metric) for d in docs for rep in d["runs"]]
        met = [r for r in per_run if r is not None and meets(r, bound, kind)]
        rows.append({"workload": workload, "peer": peer, "metric": metric, "bound": bound, "kind": kind,
                     "per_run": per_run, "met": len(met), "runs": sum(r is not None for r in per_run),
                     "per_repetition": [p for p in pairs if p is not None],
                     "per_run_ceiling": [_ceiling_ratio(d, workload, peer) for d in docs]
                     if metric == "output_throughput" else []})  # fmt: skip
    lines = [f"{len(docs)} runs: {', '.join(path.name for path in paths)}"]
    for r in rows:
        sign = ">=" if r["kind"] == "min" else "<="
        runs = ", ".join(_num(v, ".2f") for v in r["per_run"])
        reps = sorted(r["per_repetition"])
        spread = f"{reps[0]:.2f}-{reps[-1]:.2f}, median {statistics.median(reps):.2f}" if reps else "-"
        lines.append(f"{r['workload']}/{r['peer']} {r['metric']} (target {sign} {r['bound']:g}x): runs {runs}; "
                     f"met in {r['met']} of {r['runs']}; {len(reps)} repetitions {spread}")  # fmt: skip
        if any(c is not None for c in r["per_run_ceiling"]):
            caps = ", ".join(_num(c, ".2f") for c in r["per_run_ceiling"])
            reachable = sum(c is not None and meets(c, r["bound"], r["kind"]) for c in r["per_run_ceiling"])
            lines.append(f"  the most the arrivals allowed: runs {caps}; reachable in {reachable} of {r['runs']}")
    return "\n".join(lines), {"files": [str(p) for p in paths], "targets": rows}


def _run_document(path: Path) -> dict[str, Any]:
    """A run's JSON (what a run of this script writes); SystemExit naming the file otherwise."""
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
        if all(isinstance(doc.get(key), want) for key, want in (("targets", list), ("ratios", dict), ("runs", list))):
            return doc
    except (OSError, ValueError, AttributeError) as exc:
        raise SystemExit(f"--across {path}: {exc}") from None
    raise SystemExit(f"--across {path}: not a run of engine_vs_peer.py (no targets, ratios and runs)")


def _ceiling_ratio(doc: dict[str, Any], workload: str, peer: str) -> float | None:
    """The highest tokens/s ratio the workload's arrivals allowed against `peer` in one run."""
    ceiling = ceilings_of(doc.get("workloads", [])).get(workload)
    theirs = (doc["medians"].get(workload, {}).get(peer) or {}).get("output_throughput") if "medians" in doc else None
    return ceiling / theirs if ceiling and theirs else None


def _pair_ratio(rep: dict[str, Any], workload: str, peer: str, metric: str) -> float | None:
    ours, theirs = (rep.get(s, {}).get(workload) for s in ("contbatch", peer))
    if not isinstance(ours, dict) or not isinstance(theirs, dict) or not theirs.get(metric) or metric not in ours:
        return None
    return float(ours[metric] / theirs[metric])


def problem(reps: list[dict[str, Any]], server: str, workload: str) -> str:
    """The first error of `server` on `workload` (a failed start, a skip, a failed request), or ''."""
    for rep in reps:
        run = rep.get(server)
        if not isinstance(run, dict):
            continue
        result = run.get(workload, run if "error" in run else None)
        if not isinstance(result, dict):
            continue
        if "error" in result:
            return str(result["error"]).strip().splitlines()[0][:100]
        if result.get("failed") and result.get("errors"):
            return f"{result['failed']} failed: {str(result['errors'][0])[:80]}"
    return ""


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--reps", type=int, default=None, help="repetitions, servers interleaved (default 3; --quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help="12/12/4 requests, short outputs: a smoke test")
    default = ",".join(s for s in SERVERS if s != "baseline")
    parser.add_argument("--servers", default=default, help=f"a subset of {default} (--baseline adds baseline)")
    parser.add_argument("--baseline", help="a commit: also run its contbatch server (the `baseline` server)")
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV capacity of each server, in tokens")
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per step (both servers)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="contbatch's and transformers serve's: cpu or cuda")
    parser.add_argument("--contbatch-flags", default=CONTBATCH_FLAGS,
                        help=f"the contbatch server's serving flags (default {CONTBATCH_FLAGS!r})")  # fmt: skip
    parser.add_argument("--baseline-flags", default="", help="the baseline server's serving flags (default none)")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_DIR / "build" / "bin" / "llama-server")
    parser.add_argument("--gguf", type=Path, default=LLAMA_DIR / "demo-f32.gguf")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/contbatch-engine-vs-peer"))
    parser.add_argument("--json-out", type=Path, help=f"default {RESULTS / 'engine_vs_peer.json'} (--across: "
                        f"{RESULTS / 'engine_vs_peer_across.json'})")  # fmt: skip
    parser.add_argument("--across", type=Path, nargs="+", metavar="JSON",
                        help="start no server: each target over these runs' JSON files (their spread)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.json_out is None:
        args.json_out = RESULTS / ("engine_vs_peer_across.json" if args.across else "engine_vs_peer.json")
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SERVERS))
    if unknown or not names or args.reps < 1:
        parser.error(f"--servers: any of {', '.join(SERVERS)} (unknown: {unknown}); --reps must be >= 1")
    if "baseline" in names and not args.baseline:
        parser.error("--servers baseline needs --baseline COMMIT")
    if args.kv_tokens % PEER_BLOCK:
        parser.error(f"--kv-tokens must be a multiple of {PEER_BLOCK} (transformers' block)")
    args.server_list = [*names, "baseline"] if args.baseline and "baseline" not in names else names
    return args


def available(args: argparse.Namespace, setup: Setup) -> tuple[list[str], dict[str, str]]:
    """The servers that can run here, and a note for each that cannot."""
    from contbatch.bench.servers import transformers_serve_missing

    notes: dict[str, str] = {}
    if "transformers" in args.server_list and (why := transformers_serve_missing()):
        notes["transformers"] = f"transformers serve: skipped ({why})"
    if "llama.cpp" in args.server_list and (why := llama_missing(setup)):
        notes["llama.cpp"] = why
    return [s for s in SERVERS if s in args.server_list and s not in notes], notes


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.across:
        text, document = across_runs(args.across)
        print(text)
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(document, indent=1) + "\n")
        print(f"json: {args.json_out}")
        return 0
    import torch

    from contbatch.engine.demo import ensure_demo_model
    from contbatch.engine.kv_cache import bytes_per_block
    from contbatch.engine.loader import load_spec

    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_demo_model()
    kv_mib = kv_mib_for(args.kv_tokens, bytes_per_block(load_spec(str(model)), 1, torch.float32))
    baseline = export_baseline(args.baseline, args.work_dir) if args.baseline else None
    setup = Setup(model, args.kv_tokens, kv_mib, args.token_budget, args.threads, args.llama_server, args.gguf,
                  args.work_dir, baseline, tuple(shlex.split(args.contbatch_flags)),
                  tuple(shlex.split(args.baseline_flags)), args.device)  # fmt: skip
    items = workloads(args.quick)
    traces = write_traces(items, model, args.work_dir)
    names, notes = available(args, setup)
    for note in notes.values():
        print(note, file=sys.stderr)
    reps: list[dict[str, Any]] = []
    started = time.time()
    for rep in range(args.reps):
        order = names if rep % 2 == 0 else names[::-1]
        reps.append({})
        for name in order:
            print(f"rep {rep + 1}/{args.reps}: {name}", file=sys.stderr, flush=True)
            reps[-1][name] = one_server(name, setup, items, traces, args.quick)
    summary = summarize_reps(items, reps, ceilings_of([{**w.__dict__, **traces[w.name]} for w in items]))
    text = table(items, summary, notes)
    if args.baseline:
        flags = repr(args.baseline_flags) if args.baseline_flags else "the server's default flags"
        text += f"\nbaseline: the contbatch server of commit {args.baseline}, with {flags}"
    print(text)
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
        "quick": args.quick,
        "model": str(model),
        "config": {
            "kv_tokens": args.kv_tokens,
            "kv_cache_mib": kv_mib,
            "token_budget": args.token_budget,
            "threads": args.threads,
            "device": args.device,
            "peer_block": PEER_BLOCK,
            "llama_slots": LLAMA_SLOTS,
            "llama_ctx": LLAMA_CTX,
        },
        "argv": {name: server_argv(name, setup, 0) for name in SERVERS},
        "baseline": args.baseline,
        "notes": notes,
        "workloads": [{**w.__dict__, "rate": str(w.rate), "label": w.label, **traces[w.name]} for w in items],
        "targets": [
            {"workload": w, "peer": p, "metric": k, "bound": b, "kind": kind}
            for (w, p), rows in TARGETS.items()
            for k, b, kind in rows
        ],
        "runs": reps,
        **summary,
        "table": text,
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(run())
