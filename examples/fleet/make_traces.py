"""Write the synthetic traces the fleet examples run (docs/fleets.md), from fixed seeds:

- long-prompts.jsonl: 600 requests, Poisson 6 req/s, prompts log-normal around 3,000 tokens
  (1,024-8,000), outputs log-normal around 96 (16-512): prefill-heavy, like RAG or code;
- short-prompts.jsonl: 600 requests, Poisson 6 req/s, prompts log-normal around 160 tokens
  (32-1,024), outputs log-normal around 400 (64-1,500): decode-heavy, like chat;
- bursty.jsonl: 2 req/s for 600 s, 32 req/s for 300 s, 2 req/s for 600 s again; prompts
  log-normal around 600 tokens, outputs around 160: one burst for an autoscaler.

    .venv/bin/python examples/fleet/make_traces.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from contbatch.traces import Trace, write_jsonl
from contbatch.traces.synthetic import generate, lognormal, poisson

HERE = Path(__file__).resolve().parent


def bursty() -> Trace:
    phases = [(2.0, 600.0), (32.0, 300.0), (2.0, 600.0)]
    requests = []
    start = 0.0
    for k, (rate, length) in enumerate(phases):
        part = generate(f"phase{k}", None, poisson(rate), lognormal(600, 0.6, 64, 4000), lognormal(160, 0.6, 16, 1024),
                        seed=900 + k, until=length)  # fmt: skip
        requests += [dataclasses.replace(r, arrival_ts=start + r.arrival_ts) for r in part.requests]
        start += length
    return Trace("bursty", tuple(requests), "s", "2 req/s for 600 s, 32 req/s for 300 s, 2 req/s for 600 s")


def main() -> None:
    long = generate("long", 600, poisson(6), lognormal(3000, 0.5, 1024, 8000), lognormal(96, 0.7, 16, 512), seed=910)
    short = generate("short", 600, poisson(6), lognormal(160, 0.6, 32, 1024), lognormal(400, 0.5, 64, 1500), seed=920)
    for name, trace in (("long-prompts", long), ("short-prompts", short), ("bursty", bursty())):
        write_jsonl(trace, HERE / f"{name}.jsonl")
        print(f"wrote {HERE / name}.jsonl: {len(trace)} requests")


if __name__ == "__main__":
    main()
