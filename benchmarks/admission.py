"""Admission before work, measured against a real `contbatch serve` process (issue 15).

Two scenarios, each against a fresh server (a subprocess; the clients run here):

- huge prompts: `--rounds` rounds of `--concurrency` concurrent ~3.9 MB prompts (completions and
  chat, under the 4 MiB body limit) while `/health` is polled every 10 ms and a 400-token stream
  runs. Reported: /health latency (p50, p99, max), the stream's largest gap between tokens, the
  statuses of the huge requests, and the server's RSS before and after. The claim checked with
  `--check`: /health p99 under 200 ms, every huge prompt refused with a 400, the stream done,
  RSS growth under 200 MB.
- stalled clients: `max_num_seqs` clients that never read take every seat; reported is how long
  a normal request then takes to complete (about `lifecycle.max_pause`, 2 s by default).

    .venv/bin/python benchmarks/admission.py                    # the sim backend
    .venv/bin/python benchmarks/admission.py --backend engine   # the demo model (needs torch)

Prints a table and writes JSON (--json-out).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from contbatch.bench.servers import contbatch_argv, free_port, running_server

HUGE_CHARS = 3_900_000
ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def serve(args: argparse.Namespace, *extra: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    command = ["serve", "--backend", args.backend, "--served-model-name", "bench", *extra]
    if args.backend == "sim":
        command += ["--cost", "affine:base_ms=5"]
    with running_server(contbatch_argv(*command, port=port), port, cwd=ROOT, start_s=300, stop_s=30) as server:
        yield server.url, server.process.pid


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def one_round(url: str, huge: list[tuple[str, bytes]], concurrency: int) -> dict[str, list[Any]]:
    """A 400-token stream while /health is polled, with `concurrency` huge prompts sent at once."""
    out: dict[str, list[Any]] = {"latencies": [], "gaps": [], "statuses": [], "done": []}
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                start = time.perf_counter()
                http.get(url + "/health")
                out["latencies"].append(time.perf_counter() - start)
                time.sleep(0.01)

    def stream() -> None:
        body = {"model": "bench", "prompt": "a concurrent stream", "max_tokens": 400, "ignore_eos": True}
        with (
            httpx.Client(timeout=300) as http,
            http.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r,
        ):
            last = time.perf_counter()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.perf_counter()
                    out["gaps"].append(now - last)
                    last = now
                    if line == "data: [DONE]":
                        out["done"].append(True)

    def send(path: str, raw: bytes) -> None:
        with httpx.Client(timeout=300) as http:
            r = http.post(url + path, content=raw, headers={"content-type": "application/json"})
            out["statuses"].append(r.status_code)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.3)
    threads = [threading.Thread(target=stream)]
    threads += [threading.Thread(target=send, args=huge[i % len(huge)]) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    poller.join()
    return out


def huge_prompts(args: argparse.Namespace) -> dict[str, Any]:
    bodies = [
        ("/v1/completions", {"model": "bench", "prompt": "abc " * (HUGE_CHARS // 4), "max_tokens": 16}),
        (
            "/v1/chat/completions",
            {"model": "bench", "messages": [{"role": "user", "content": "wxyz " * (HUGE_CHARS // 5)}]},
        ),
    ]
    encoded = [(path, json.dumps(body).encode()) for path, body in bodies]
    with serve(args) as (url, pid):
        one_round(url, encoded, 0)  # warm-up
        base = one_round(url, encoded, 0)  # the stream alone: what the backend itself costs
        rss_before = rss_mb(pid)
        rounds = [one_round(url, encoded, args.concurrency) for _ in range(args.rounds)]
        rss_after = rss_mb(pid)
    latencies = [x for r in rounds for x in r["latencies"]]
    gaps = [x for r in rounds for x in r["gaps"]]
    statuses = [x for r in rounds for x in r["statuses"]]
    return {
        "baseline_health_p99_ms": 1000 * percentile(base["latencies"], 0.99),
        "baseline_stream_max_gap_ms": 1000 * max(base["gaps"]),
        "health_samples": len(latencies),
        "health_p50_ms": 1000 * statistics.median(latencies),
        "health_p99_ms": 1000 * percentile(latencies, 0.99),
        "health_max_ms": 1000 * max(latencies),
        "stream_max_gap_ms": 1000 * max(gaps),
        "streams_done": sum(len(r["done"]) for r in rounds),
        "huge_statuses": sorted(set(statuses)),
        "huge_requests": len(statuses),
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_after,
    }


def stalled_clients(args: argparse.Namespace) -> dict[str, Any]:
    seats = 4
    with serve(args, "--set", f"max_num_seqs={seats}") as (url, _):
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(
            {"model": "bench", "prompt": "never read", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        )
        raw = body.encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(raw)}\r\n\r\n"
        socks = []
        for _ in range(seats):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(head.encode() + raw)
            socks.append(sock)
        time.sleep(1.0)  # the stalled requests take the seats
        start = time.perf_counter()
        r = httpx.post(
            url + "/v1/completions", json={"model": "bench", "prompt": "normal", "max_tokens": 8}, timeout=600
        )
        took = time.perf_counter() - start
        for sock in socks:
            sock.close()
    return {"normal_request_status": r.status_code, "normal_request_s": took}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sim", choices=("sim", "engine"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4, help="huge prompts at once")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 unless the claims hold")
    args = parser.parse_args()
    result = {"backend": args.backend, "cpus": os.cpu_count(), **huge_prompts(args), **stalled_clients(args)}
    width = max(map(len, result))
    for key, value in result.items():
        shown = f"{value:.1f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    claims = {
        "health p99 < 200 ms": result["health_p99_ms"] < 200,
        "every huge prompt refused with 400": result["huge_statuses"] == [400],
        "the stream completed each round": result["streams_done"] == args.rounds,
        "RSS growth < 200 MB": result["rss_after_mb"] - result["rss_before_mb"] < 200,
        "a normal request completes beside stalled clients": result["normal_request_status"] == 200,
    }
    for claim, held in claims.items():
        print(f"{'ok  ' if held else 'FAIL'} {claim}")
    return 0 if (all(claims.values()) or not args.check) else 1


if __name__ == "__main__":
    raise SystemExit(main())
