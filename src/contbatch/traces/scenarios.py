"""The synthetic built-in traces: one scheduling question each, generated from fixed seeds.

Each is made by `contbatch.traces.synthetic` from its own fixed seed on first use and cached, so
every load, in any process, gives the same trace. All are in seconds and sized for the
simulator's ``affine`` cost model (a 7B model on an A100: one decode at 576 tokens of context
~9.5 ms, 32 of them ~16 ms, a 512-token prefill ~38 ms) with a KV cache of ~98,000 tokens.
Each trace's ``source`` says it is synthetic, gives its generator parameters and its purpose.

- ``kv-pressure``: everyone asks for max_tokens 2048 but uses 64-1024: conservative admission
  reserves ~4x what is used, optimistic admission fits more and risks preemption;
- ``long-prompt``: one 8,000-token prompt (id ``long``) at t = 20 s among short requests: head-of-
  line blocking, and what chunked prefill buys the requests behind and beside it;
- ``multi-tenant``: tenant ``heavy`` floods, ``light-1``..``light-4`` trickle: fairness;
- ``priority-mix``: priorities 0 / 1 / 2 (lower first) in 20 / 30 / 50 %: priority queueing;
- ``deadlines``: deadlines 2-20 s after arrival: deadline-aware ordering and goodput;
- ``cancel-storm``: half the clients cancel 0.5-8 s after arriving: freeing KV on cancellation
  and generated-but-unsent waste;
- ``slow-readers``: 30 % of clients read 5-20 tokens/s: streaming backpressure (output credits);
- ``prefix-share``: four system prompts of 512-2048 tokens shared by their groups: prefix caching.

Invariants: exact counts where the text gives a fraction (e.g. exactly half cancel; which ones is
drawn at random); every random choice is from `synthetic.substream` of the trace's seed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable

from contbatch.traces.schema import Trace, TraceRequest
from contbatch.traces.synthetic import generate, poisson, substream, uniform

_PREFIX = "synthetic (contbatch.traces.synthetic, seed {seed}): "
LONG_PROMPT_ID = "long"
PREFIX_TOKENS: tuple[int, ...] = (512, 1024, 1536, 2048)  # of groups sys-0 .. sys-3


def _trace(name: str, requests: Iterable[TraceRequest], seed: int, description: str) -> Trace:
    return Trace(name=name, requests=tuple(requests), time_unit="s", source=_PREFIX.format(seed=seed) + description)


def _chosen(count: int, fraction: float, seed: int, purpose: str) -> frozenset[int]:
    """Exactly round(count * fraction) indices out of range(count), drawn at random."""
    return frozenset(substream(seed, purpose).sample(range(count), round(count * fraction)))


@functools.cache
def kv_pressure() -> Trace:
    seed = 100
    base = generate("kv-pressure", 300, poisson(5), uniform(256, 2048), uniform(64, 1024), seed=seed)
    requests = (dataclasses.replace(r, max_output_tokens=2048) for r in base)
    description = (
        "300 requests, Poisson 5 req/s, prompts uniform 256-2048, outputs uniform 64-1024, max_tokens 2048 "
        "for all; for KV admission: a conservative reservation holds ~4x the output tokens really used"
    )
    return _trace("kv-pressure", requests, seed, description)


@functools.cache
def long_prompt() -> Trace:
    seed = 200
    short = generate("short", None, poisson(4), uniform(64, 256), uniform(64, 128), seed=seed, until=60.0)
    long = TraceRequest(LONG_PROMPT_ID, 20.0, num_prompt_tokens=8000, num_output_tokens=16)
    description = (
        "Poisson 4 req/s for 60 s (ids short-N), prompts uniform 64-256, outputs uniform 64-128, plus one "
        "request 'long' (8000 prompt tokens, 16 output) at t=20 s; for head-of-line blocking and chunked prefill"
    )
    return _trace("long-prompt", (*short, long), seed, description)


@functools.cache
def multi_tenant() -> Trace:
    seed = 300
    heavy = generate("heavy", None, poisson(6), uniform(1024, 2048), uniform(128, 256), seed=seed, until=60.0)
    requests = [dataclasses.replace(r, tenant="heavy") for r in heavy]
    for k in range(1, 5):
        tenant = f"light-{k}"
        light = generate(tenant, None, poisson(0.5), uniform(64, 256), uniform(32, 64), seed=seed + k, until=60.0)
        requests.extend(dataclasses.replace(r, tenant=tenant) for r in light)
    description = (
        f"60 s; tenant heavy: Poisson 6 req/s, prompts uniform 1024-2048, outputs uniform 128-256 (seed {seed}); "
        f"tenants light-1..light-4: each Poisson 0.5 req/s, prompts uniform 64-256, outputs uniform 32-64 "
        f"(seeds {seed + 1}..{seed + 4}); for tenant fair share vs FCFS"
    )
    return _trace("multi-tenant", requests, seed, description)


@functools.cache
def priority_mix() -> Trace:
    seed = 400
    base = generate("priority-mix", 400, poisson(16), uniform(256, 1024), uniform(64, 256), seed=seed)
    priorities = [0] * 80 + [1] * 120 + [2] * 200
    substream(seed, "priorities").shuffle(priorities)
    requests = (dataclasses.replace(r, priority=p) for r, p in zip(base, priorities, strict=True))
    description = (
        "400 requests, Poisson 16 req/s (above the affine engine's capacity, so a queue forms), prompts uniform "
        "256-1024, outputs uniform 64-256, priority 0 (lower runs first) for 20 %, 1 for 30 %, 2 for 50 %, "
        "shuffled; for priority queue order"
    )
    return _trace("priority-mix", requests, seed, description)


@functools.cache
def deadlines() -> Trace:
    seed = 500
    base = generate("deadlines", 300, poisson(12), uniform(128, 1024), uniform(32, 256), seed=seed)
    slack = substream(seed, "slack")
    requests = (dataclasses.replace(r, deadline_ts=r.arrival_ts + slack.uniform(2.0, 20.0)) for r in base)
    description = (
        "300 requests, Poisson 12 req/s, prompts uniform 128-1024, outputs uniform 32-256, deadline = arrival + "
        "uniform 2-20 s; for deadline-aware queue order (a queue forms with max_num_seqs=32)"
    )
    return _trace("deadlines", requests, seed, description)


@functools.cache
def cancel_storm() -> Trace:
    seed = 600
    base = generate("cancel-storm", 300, poisson(5), uniform(128, 1024), uniform(128, 512), seed=seed)
    cancelling = _chosen(len(base), 0.5, seed, "cancelling")
    after = substream(seed, "cancel-after")
    requests = (
        dataclasses.replace(r, cancel_ts=r.arrival_ts + after.uniform(0.5, 8.0)) if i in cancelling else r
        for i, r in enumerate(base)
    )
    description = (
        "300 requests, Poisson 5 req/s, prompts uniform 128-1024, outputs uniform 128-512; a random half cancel "
        "at arrival + uniform 0.5-8 s; for freeing KV on cancellation and generated-but-unsent waste"
    )
    return _trace("cancel-storm", requests, seed, description)


@functools.cache
def slow_readers() -> Trace:
    seed = 700
    base = generate("slow-readers", 200, poisson(4), uniform(128, 512), uniform(128, 512), seed=seed)
    slow = _chosen(len(base), 0.3, seed, "slow")
    rates = substream(seed, "read-rate")
    requests = (
        dataclasses.replace(r, read_rate=rates.uniform(5.0, 20.0)) if i in slow else r for i, r in enumerate(base)
    )
    description = (
        "200 requests, Poisson 4 req/s, prompts uniform 128-512, outputs uniform 128-512; a random 30 % read "
        "uniform 5-20 tokens/s, the rest unlimited; for streaming backpressure (output credits)"
    )
    return _trace("slow-readers", requests, seed, description)


@functools.cache
def prefix_share() -> Trace:
    seed = 800
    base = generate("prefix-share", 300, poisson(5), uniform(32, 256), uniform(32, 256), seed=seed)
    groups = substream(seed, "groups")
    requests = []
    for r in base:
        group = groups.randrange(len(PREFIX_TOKENS))
        prefix = PREFIX_TOKENS[group]
        requests.append(
            dataclasses.replace(
                r, num_prompt_tokens=prefix + r.num_prompt_tokens, prefix_group=f"sys-{group}", prefix_tokens=prefix
            )
        )
    description = (
        "300 requests, Poisson 5 req/s, each in a uniformly drawn prefix group sys-0..sys-3 sharing a 512 / 1024 / "
        "1536 / 2048-token prefix, prompt = prefix + uniform 32-256 own tokens, outputs uniform 32-256; "
        "for prefix caching"
    )
    return _trace("prefix-share", requests, seed, description)


@functools.cache
def seed_scaled() -> Trace:
    """The specification's three requests, made big enough for a real engine: prompts x64,
    outputs x32, C arriving at 0.6 s (after B is done and while A still decodes, on the demo
    model on a 2-core CPU), in seconds."""
    requests = (
        TraceRequest("A", 0.0, 4 * 64, 5 * 32),
        TraceRequest("B", 0.0, 2 * 64, 2 * 32),
        TraceRequest("C", 0.6, 3 * 64, 4 * 32),
    )
    description = (
        "the specification's worked example scaled for a real engine: A=(0 s, 256, 160), B=(0 s, 128, 64), "
        "C=(0.6 s, 192, 128) as (arrival, prompt tokens, output tokens); for contbatch run"
    )
    return Trace(name="seed-scaled", requests=requests, time_unit="s", source="contbatch: " + description)


SCENARIOS: dict[str, Callable[[], Trace]] = {
    "seed-scaled": seed_scaled,
    "kv-pressure": kv_pressure,
    "long-prompt": long_prompt,
    "multi-tenant": multi_tenant,
    "priority-mix": priority_mix,
    "deadlines": deadlines,
    "cancel-storm": cancel_storm,
    "slow-readers": slow_readers,
    "prefix-share": prefix_share,
}
