"""Where a burst's TTFT goes, burst after burst: the client's view against the server's own.

    .venv/bin/python benchmarks/first_burst.py [--device cuda] [--reps 3] [--requests 48]

`contbatch serve --backend engine` on the demo model (float32, KV for 32,768 tokens, token
budget 4,096; as benchmarks/gpu_check.sh), started once per flag set (the server's defaults, and
engine_vs_peer.py's `--set queue_order=shortest --set defer_partial_prefills=true --gather-gap
0.01`), warmed with 4 requests of 64/8 tokens, then ``--reps`` bursts of ``--requests`` requests of
256 prompt and 128 output tokens, all at once, by `contbatch bench`. Around each burst it reads the
server's /metrics, so each row holds the client's p50 and mean TTFT beside the server's own mean
TTFT and queue time for the same requests (`contbatch:time_to_first_token_seconds`,
`request_queue_time_seconds`: from the request's arrival in the engine loop) and the steps the
burst took (count, mean, their sum: the engine's busy time). The first burst of a server against
the later ones shows what a server pays once; the client's TTFT less the server's is what the
HTTP side and the client add.

Prints one row per burst and writes everything (histogram buckets too) to ``--json-out``.
It ran on an NVIDIA H200 (eighteenth and nineteenth sessions): `benchmarks/results/
first_burst_h200.json` (before `contbatch.engine.load.warm_up`) and `first_burst_warm_h200.json`
(with it); docs/engine.md#gpu.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

FLAG_SETS = {
    "defaults": [],
    "engine_vs_peer": ["--set", "queue_order=shortest", "--set", "defer_partial_prefills=true", "--gather-gap", "0.01"],
}
HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds", "step_duration_seconds")
KV_TOKENS, TOKEN_BUDGET = 32768, 4096
_SAMPLE = re.compile(r"contbatch:([a-z_]+?)(_sum|_count|_bucket)(\{[^}]*\})? ([0-9.e+-]+)$")


def scrape(url: str) -> dict[str, float]:
    """The server's histograms: NAME_sum, NAME_count and NAME_bucketLE, summed over label sets."""
    got: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in HISTOGRAMS:
            le = re.search(r'le="([^"]+)"', m.group(3) or "") if m.group(2) == "_bucket" else None
            key = m.group(1) + m.group(2) + (le.group(1) if le else "")
            got[key] = got.get(key, 0.0) + float(m.group(4))
    return got


def bench(url: str, model: str, work: Path, label: str, *, count: int, prompt: int, output: int) -> dict[str, Any]:
    """One all-at-once run of `contbatch bench`; its result file."""
    name = f"{label}.json"
    cmd = [sys.executable, "-m", "contbatch.cli.main", "bench", "--base-url", url, "--model", model,
           "--num-prompts", str(count), "--input-len", str(prompt), "--output-len", str(output),
           "--request-rate", "inf", "--seed", "0", "--timeout", "60", "--disable-tqdm", "--save-result",
           "--result-dir", str(work), "--result-filename", name]  # fmt: skip
    subprocess.run(cmd, timeout=120, capture_output=True, text=True, check=False)
    result: dict[str, Any] = json.loads((work / name).read_text())
    return result


def burst_row(result: dict[str, Any], before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The client's numbers for one burst beside the server's histograms over the same burst."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    row: dict[str, Any] = {
        "client_p50_ttft_ms": result["median_ttft_ms"],
        "client_mean_ttft_ms": result["mean_ttft_ms"],
        "duration_s": result["duration"],
        "tok_s": result["output_throughput"],
        "tpot_ms": result["mean_tpot_ms"],
    }
    for h in HISTOGRAMS:
        count = delta.get(h + "_count", 0.0)
        row[h + "_mean_ms"] = 1000 * delta.get(h + "_sum", 0.0) / count if count else None
        row[h + "_count"] = count
    row["steps_busy_s"] = delta.get("step_duration_seconds_sum")
    for h, short in (("time_to_first_token_seconds", "ttft"), ("step_duration_seconds", "step")):
        row[short + "_buckets"] = {k[len(h + "_bucket") :]: v for k, v in delta.items() if k.startswith(h + "_bucket")}
    return row


def serve_bursts(args: argparse.Namespace, model: str, flags: list[str], label: str, work: Path) -> dict[str, Any]:
    """Start the server with `flags`, warm it with a small run, then `args.reps` bursts."""
    import torch

    from contbatch.bench.servers import contbatch_argv, free_port, running_server
    from contbatch.engine.kv_cache import bytes_per_block
    from contbatch.engine.loader import load_spec

    kv_mib = KV_TOKENS * bytes_per_block(load_spec(model), 1, torch.float32) // 2**20
    port = free_port()
    argv = contbatch_argv("serve", "--backend", "engine", "--model", model, "--served-model-name", model,
                          "--device", args.device, "--dtype", "float32", "--kv-cache-memory", str(kv_mib),
                          "--set", f"max_num_batched_tokens={TOKEN_BUDGET}", *flags, port=port)  # fmt: skip
    started = time.time()
    with running_server(argv, port, start_s=180, log=work / f"{label}.log") as server:
        healthy_s = time.time() - started
        bench(server.url, model, work, f"{label}-warm", count=4, prompt=64, output=8)
        bursts = []
        for rep in range(args.reps):
            before = scrape(server.url)
            result = bench(server.url, model, work, f"{label}-{rep}", count=args.requests, prompt=256, output=128)
            bursts.append(burst_row(result, before, scrape(server.url)))
    return {"flags": flags, "healthy_after_s": healthy_s, "bursts": bursts}


def table(runs: dict[str, Any]) -> str:
    head = f"{'flags':16s} {'burst':>5s} {'client p50':>10s} {'client mean':>11s} {'server TTFT':>11s} {'queue':>7s}"
    head += f" {'steps':>5s} {'step ms':>7s} {'tok/s':>7s}"
    lines = [head, "-" * len(head)]
    for label, run in runs.items():
        for i, b in enumerate(run["bursts"]):
            lines.append(
                f"{label:16s} {i + 1:5d} {b['client_p50_ttft_ms']:10.0f} {b['client_mean_ttft_ms']:11.0f} "
                f"{b['time_to_first_token_seconds_mean_ms']:11.0f} {b['request_queue_time_seconds_mean_ms']:7.0f} "
                f"{b['step_duration_seconds_count']:5.0f} {b['step_duration_seconds_mean_ms']:7.1f} {b['tok_s']:7.0f}"
            )
    lines.append("ms; client: contbatch bench's TTFT; server: its /metrics (mean TTFT, queue time, steps), same burst")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--reps", type=int, default=3, help="bursts per server")
    parser.add_argument("--requests", type=int, default=48, help="requests per burst")
    parser.add_argument("--json-out", type=Path, default=Path("benchmarks/results/first_burst.json"))
    args = parser.parse_args(argv)
    if args.reps < 1 or args.requests < 1:
        parser.error("--reps and --requests must be >= 1")
    from contbatch.engine.demo import ensure_demo_model

    model = str(ensure_demo_model())
    with tempfile.TemporaryDirectory(prefix="first-burst-") as tmp:
        runs = {label: serve_bursts(args, model, flags, label, Path(tmp)) for label, flags in FLAG_SETS.items()}
    document = {"device": args.device, "requests": args.requests, "kv_tokens": KV_TOKENS, "token_budget": TOKEN_BUDGET,
                "runs": runs}  # fmt: skip
    print(table(runs))
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
