#!/usr/bin/env bash
# benchmarks/gpu_check.sh: the engine on one CUDA GPU, in at most 8 minutes (issue 19, item 4).
# It ran on an NVIDIA H200 on 2026-12-04 and passed in 151 s: docs/engine.md#gpu.
#
# Three steps, each under its own `timeout`, then benchmarks/results/gpu_check.json:
#   1. tests    `pytest -m cuda tests/engine`: the CUDA cases of tests/engine/test_engine_device.py
#               (forward and greedy against transformers on CUDA in float32, bfloat16 and float16,
#               LLMEngine with EngineConfig(device="cuda") under chunked prefill and swap, the
#               paged KV cache, every sampling rule, step synchronisation). A skipped case fails
#               the step: on a GPU nothing may skip.                              (at most 120 s)
#   2. exact    token-exactness on the 30M demo model (~/.cache/contbatch/demo-model, created if
#               missing): 16 prompts of 16-512 tokens, 64 greedy tokens each, LLMEngine on CUDA
#               (all requests at once: continuous batching, chunked prefill) against transformers'
#               `generate` on CUDA, one prompt at a time. float32 must be token-exact; bfloat16
#               and float16 are reported (matching prefix per request), not gated. (at most 100 s)
#   3. peer     `contbatch serve --backend engine --device cuda` against `transformers serve
#               --continuous-batching --device cuda`, same demo model in float32, the same KV capacity (32,768 tokens) and token budget
#               (4,096), driven by `contbatch bench`: a warm-up, then 48 requests of 256 prompt
#               and 128 output tokens all at once and at Poisson 8/s, the two servers interleaved.
#               Requests are plain OpenAI (transformers serve refuses `ignore_eos` with 422), so an
#               output may stop early at EOS.                                    (at most 170 s)
# With the checks before (nvidia-smi 15 s, torch.cuda 20 s), 5 s of grace per step and the JSON
# after (20 s), the whole run stays under 8 minutes (460 s) even when every step hits its limit.
# GPU_CHECK_JSON=PATH writes the results there instead of benchmarks/results/gpu_check.json.
# GPU_CHECK_LOGS=DIR keeps the steps' files (JUnit XML, server logs, bench results) as
# DIR/gpu_check_work.tgz: a GPU is often lent for one run, and a failure must be readable after it.
#
# Without a GPU it runs nothing, prints "NOT RUN" and exits 2; it never writes the results file
# then. Exit 0: every step passed; 1: a step failed or timed out (the JSON says which).
#
# It installs nothing. It needs a Python with a CUDA build of torch, transformers (with its
# serving extras: fastapi, uvicorn) and contbatch's dependencies; contbatch itself is imported
# from src/ (PYTHONPATH), so no install is needed. A CUDA environment, made once where the
# network is reachable (the project's .venv holds the CPU build: never put a CUDA torch there):
#     python3.11 -m venv .venv-cuda
#     .venv-cuda/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128
#     .venv-cuda/bin/pip install -e '.[dev]'
#     PYTHON=.venv-cuda/bin/python benchmarks/gpu_check.sh
#
#     benchmarks/gpu_check.sh --cpu-rehearsal
# runs the same three steps on the CPU with small workloads (the CPU cases of the device tests,
# 4 prompts x 8 tokens, 8 requests of 64/16 tokens) and writes $TMPDIR/gpu_check_rehearsal.json:
# it checks the plumbing (servers, bench, JSON) on a machine without a GPU. It is not a GPU result.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

MODE=gpu
case "${1:-}" in
  "") ;;
  --cpu-rehearsal) MODE=rehearsal ;;
  *) echo "usage: $0 [--cpu-rehearsal]" >&2; exit 64 ;;
esac

if [[ $MODE == gpu ]]; then
  DEVICE=cuda
  OUT_JSON=${GPU_CHECK_JSON:-$ROOT/benchmarks/results/gpu_check.json}
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! timeout 15 nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: NOT RUN: no NVIDIA GPU here (nvidia-smi is missing or fails); nothing was checked on a GPU." >&2
    exit 2
  fi
  if ! timeout 20 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: NOT RUN: $PY has no CUDA torch or sees no CUDA device (see this script's header)." >&2
    exit 2
  fi
else
  DEVICE=cpu
  OUT_JSON=${TMPDIR:-/tmp}/gpu_check_rehearsal.json
fi

WORK=$(mktemp -d)
keep_work() {  # on exit: the steps' files to $GPU_CHECK_LOGS (if set), then away
  if [[ -n ${GPU_CHECK_LOGS:-} ]]; then
    mkdir -p "$GPU_CHECK_LOGS" && tar -czf "$GPU_CHECK_LOGS/gpu_check_work.tgz" -C "$WORK" . || true
  fi
  rm -rf "$WORK"
}
trap keep_work EXIT
: >"$WORK/steps.tsv"
START=$SECONDS

step() {  # step NAME LIMIT_S COMMAND...: run it under `timeout`, record name, status, rc, seconds
  local name=$1 limit=$2 t0=$SECONDS rc=0 status
  shift 2
  echo "== $name (at most ${limit} s)"
  timeout --signal=TERM --kill-after=5 "$limit" "$@" || rc=$?
  case $rc in
    0) status=pass ;;
    124 | 137) status=timeout ;;
    *) status=fail ;;
  esac
  echo "== $name: $status (rc $rc, $((SECONDS - t0)) s)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" >>"$WORK/steps.tsv"
}

# -- 2. exactness ----------------------------------------------------------------------------------
cat >"$WORK/exact.py" <<'PY'
import json, random, sys, time
import torch
from transformers import LlamaForCausalLM
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.loop.params import SamplingParams

device, out_path, num_prompts, num_new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dtypes = ["float32"] + (["bfloat16", "float16"] if device == "cuda" else [])
path = ensure_demo_model()
rng = random.Random(0)
prompts = [[rng.randrange(3, 32_000) for _ in range(rng.randint(16, 512))] for _ in range(num_prompts)]
doc = {"model": str(path), "device": device, "prompts": num_prompts, "new_tokens": num_new}


def ours(dtype):
    engine = LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype, kv_cache_memory=256 * 2**20))
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return [list(r.output_token_ids) for r in requests], time.perf_counter() - t, str(engine.runner.device)


def theirs(dtype):
    model = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    outs, t = [], time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            o = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_new,
                               pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return outs, time.perf_counter() - t


for dtype in dtypes:
    got, engine_s, on = ours(dtype)
    want, hf_s = theirs(dtype)
    prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    doc[dtype] = {"engine_device": on, "equal_requests": sum(g == w for g, w in zip(got, want)),
                  "matching_prefix": prefix, "engine_s": round(engine_s, 3), "transformers_s": round(hf_s, 3)}
    print(f"{dtype}: {doc[dtype]['equal_requests']}/{num_prompts} requests token-exact "
          f"(matching prefixes {prefix}) on {on}; engine {engine_s:.2f} s, transformers {hf_s:.2f} s")
doc["float32_exact"] = doc["float32"]["equal_requests"] == num_prompts
with open(out_path, "w") as f:
    json.dump(doc, f, indent=1)
sys.exit(0 if doc["float32_exact"] and doc["float32"]["engine_device"].startswith(device) else 1)
PY

# -- 3. the engine against transformers serve --continuous-batching ---------------------------------
cat >"$WORK/peer.py" <<'PY'
import json, os, signal, socket, subprocess, sys, time, urllib.request
import torch
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.kv_cache import bytes_per_block
from contbatch.engine.loader import load_spec

device, out_path, work, small = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the servers in `finally`
py = sys.executable
path = str(ensure_demo_model())
kv_tokens, budget, peer_block = (8192, 1024, 256) if small else (32768, 4096, 256)
per_token = bytes_per_block(load_spec(path), 1, torch.float32)
kv_mib = kv_tokens * per_token // 2**20
assert kv_mib * 2**20 == kv_tokens * per_token, "choose a KV size that is a whole number of MiB"
if small:
    workloads = [("burst", "inf", 8, 64, 16), ("poisson", "4", 8, 64, 16)]
else:
    workloads = [("burst", "inf", 48, 256, 128), ("poisson", "8", 48, 256, 128)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ports = {"contbatch": free_port(), "transformers": free_port()}
argv = {
    "contbatch": [py, "-m", "contbatch.cli.main", "serve", "--backend", "engine", "--model", path,
                  "--served-model-name", path, "--port", str(ports["contbatch"]), "--kv-cache-memory", str(kv_mib),
                  "--device", device, "--dtype", "float32",
                  "--set", f"max_num_batched_tokens={budget}", "--log-level", "warning"],
    "transformers": [py, "-m", "transformers.cli.transformers", "serve", path, "--continuous-batching",
                     "--device", device, "--dtype", "float32", "--cb-block-size", str(peer_block),
                     "--cb-num-blocks", str(kv_tokens // peer_block), "--cb-max-batch-tokens", str(budget),
                     "--port", str(ports["transformers"]), "--log-level", "warning"],
}
procs = {}
doc = {"model": path, "device": device, "kv_tokens": kv_tokens, "kv_cache_mib": kv_mib, "token_budget": budget,
       "argv": argv, "runs": {}}


def healthy(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def bench(name, label, rate, n, inp, out):
    result = f"{label}-{name}.json"
    cmd = [py, "-m", "contbatch.cli.main", "bench", "--base-url", f"http://127.0.0.1:{ports[name]}", "--model", path,
           "--num-prompts", str(n), "--input-len", str(inp), "--output-len", str(out), "--request-rate", rate,
           "--seed", "0", "--timeout", "60", "--disable-tqdm", "--save-result", "--result-dir", work,
           "--result-filename", result]
    run = subprocess.run(cmd, timeout=100, capture_output=True, text=True)
    if not os.path.exists(os.path.join(work, result)):
        raise SystemExit(f"bench against {name} wrote no result (rc {run.returncode}):\n{(run.stdout + run.stderr)[-2000:]}")
    with open(os.path.join(work, result)) as f:
        r = json.load(f)
    keep = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
            "total_output_tokens")
    return {**{k: r.get(k) for k in keep}, "errors": [e for e in r.get("errors") or [] if e][:3]}


try:
    for name, cmd in argv.items():
        log = open(os.path.join(work, f"{name}.log"), "w")
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    for name, port in ports.items():
        while not healthy(port):
            if procs[name].poll() is not None or time.monotonic() > deadline:
                tail = open(os.path.join(work, f"{name}.log")).read()[-2000:]
                raise SystemExit(f"{name} server did not come up:\n{tail}")
            time.sleep(0.5)
    for name in argv:  # warm-up: first CUDA calls, allocator, kernels
        bench(name, "warmup", "inf", 4, 64, 8)
    ok = True
    for label, rate, n, inp, out in workloads:
        runs = {name: bench(name, label, rate, n, inp, out) for name in argv}  # interleaved, contbatch first
        ours, theirs = runs["contbatch"], runs["transformers"]
        ratio = {"output_throughput_x": ours["output_throughput"] / theirs["output_throughput"],
                 "p50_ttft_x_lower": theirs["median_ttft_ms"] / ours["median_ttft_ms"]}
        doc["runs"][label] = {"rate": rate, "requests": n, "input_len": inp, "output_len": out, **runs, **ratio}
        ok &= all(r["failed"] == 0 and r["completed"] == n for r in runs.values())
        print(f"{label}: contbatch {ours['output_throughput']:.1f} tok/s, p50 TTFT {ours['median_ttft_ms']:.0f} ms; "
              f"transformers {theirs['output_throughput']:.1f} tok/s, p50 TTFT {theirs['median_ttft_ms']:.0f} ms; "
              f"{ratio['output_throughput_x']:.2f}x throughput, {ratio['p50_ttft_x_lower']:.2f}x lower p50 TTFT")
    if device == "cuda":  # both servers hold GPU memory: they ran there
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20).stdout
        pids = {str(p.pid): name for name, p in procs.items()}
        doc["gpu_memory"] = {pids[pid]: mem.strip() for pid, mem in (l.split(",", 1) for l in q.splitlines() if "," in l)
                             if pid.strip() in pids}
        ok &= len(doc["gpu_memory"]) == 2
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    sys.exit(0 if ok else 1)
finally:
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3  # within `timeout`'s 5 s of grace
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
PY

if [[ $MODE == gpu ]]; then
  step tests 120 "$PY" -m pytest tests/engine -m cuda -q -p no:cacheprovider --junitxml "$WORK/tests.xml"
  step exact 100 "$PY" "$WORK/exact.py" cuda "$WORK/exact.json" 16 64
  step peer 170 "$PY" "$WORK/peer.py" cuda "$WORK/peer.json" "$WORK" 0
else
  step tests 120 "$PY" -m pytest tests/engine/test_engine_device.py -m "not cuda" -q -p no:cacheprovider \
    --junitxml "$WORK/tests.xml"
  step exact 100 "$PY" "$WORK/exact.py" cpu "$WORK/exact.json" 4 8
  step peer 170 "$PY" "$WORK/peer.py" cpu "$WORK/peer.json" "$WORK" 1
fi

# -- the results file --------------------------------------------------------------------------------
timeout 20 "$PY" - "$MODE" "$WORK" "$OUT_JSON" "$((SECONDS - START))" <<'PY'
import datetime, json, os, platform, subprocess, sys
import xml.etree.ElementTree as ET
import torch

mode, work, out_path, seconds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
steps = {}
for line in open(os.path.join(work, "steps.tsv")):
    name, status, rc, secs = line.rstrip("\n").split("\t")
    steps[name] = {"status": status, "rc": int(rc), "seconds": int(secs)}


def load(name):
    p = os.path.join(work, name)
    return json.load(open(p)) if os.path.exists(p) else None


xml = os.path.join(work, "tests.xml")
if os.path.exists(xml):
    s = ET.parse(xml).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    counts = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    steps["tests"]["counts"] = counts
    if mode == "gpu" and (counts["skipped"] or not counts["tests"]) and steps["tests"]["status"] == "pass":
        steps["tests"]["status"] = "fail"  # on a GPU, a skipped CUDA case means CUDA was not used
steps.get("exact", {})["result"] = load("exact.json")
steps.get("peer", {})["result"] = load("peer.json")
gpu = None
if mode == "gpu":
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
doc = {
    "what": "benchmarks/gpu_check.sh" + (" --cpu-rehearsal (NOT a GPU result)" if mode != "gpu" else ""),
    "ran_on_gpu": mode == "gpu",
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "gpu": gpu,
    "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
    "seconds": seconds,
    "passed": all(s["status"] == "pass" for s in steps.values()),
    "steps": steps,
}
os.makedirs(os.path.dirname(out_path), exist_ok=True)
with open(out_path, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
print(f"gpu_check ({mode}): {'PASSED' if doc['passed'] else 'FAILED'} in {seconds} s: "
      + ", ".join(f"{k} {v['status']}" for k, v in steps.items()) + f"; wrote {out_path}")
sys.exit(0 if doc["passed"] else 1)
PY
