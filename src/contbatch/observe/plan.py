"""The probe plan: which runs `contbatch observe` sends, each chosen to pin down cost terms.

Phases, in order (`PHASES`):

- ``warmup``: a few requests whose timings are kept but never fitted (first calls pay one-off
  costs: allocation, compilation, caches);
- ``prefill``: single requests, one at a time, over a grid of prompt lengths with a short output:
  their TTFT against the prompt length is the prefill cost (per prompt token and per step), their
  few gaps the cost of one decode;
- ``decode``: a concurrency sweep: N requests sent at once, with a short prompt and a long output,
  for each N in the sweep, then again with long prompts: the gaps between chunks are step times of
  N decodes at a growing context (per step, per decode, per context position);
- ``open``: mixed open-loop runs: Poisson arrivals of requests with varied prompt and output
  lengths at fractions of the server's capacity (given, or measured by a ``saturation`` run of
  the same requests all at once, sent first: `estimate_capacity`): the interplay of prefills and
  decodes under queueing.

A plan is data (`PlannedRun`s of `contbatch.bench.workload.BenchRequest`s); `contbatch.observe.probe`
sends it. Prompts are built by `contbatch.bench.workload.prompt_text` (one word per intended
token, different for every request: no accidental prefix sharing); the server's usage says what
it counted. Invariant: the plan is a pure function of `PlanConfig` (and, for ``open``, the
capacity), so two observations of one plan send the same requests.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contbatch.bench.workload import BenchRequest, from_trace, prompt_text, synthetic_trace
from contbatch.observe.record import ObservedRun
from contbatch.traces import Trace

PHASES = ("warmup", "prefill", "decode", "open")


@dataclass(frozen=True, slots=True)
class PlanConfig:
    phases: tuple[str, ...] = PHASES
    prompt_lengths: tuple[int, ...] = (16, 64, 256, 512, 1024)  # prefill grid (tokens)
    prefill_repeats: int = 2  # requests per prompt length, one at a time
    prefill_output: int = 4  # output tokens of a prefill probe
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)  # decode sweep: requests at once
    decode_prompt: int = 32
    decode_output: int = 128
    long_prompt: int = 512  # the sweep again at this prompt length (the context term); 0: not
    long_concurrency: tuple[int, ...] = (1, 4, 16)
    open_rates: tuple[float, ...] = (0.4, 0.8)  # fractions of the capacity
    open_requests: int = 40  # per open run
    open_prompt: tuple[int, int] = (32, 512)  # uniform range of prompt lengths
    open_output: tuple[int, int] = (16, 128)  # and of output lengths
    seed: int = 0
    speed_probe: bool = True  # a fixed one-request probe around every run (machine drift)

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise ValueError(f"unknown phase {', '.join(unknown) or '(none)'}; known: {', '.join(PHASES)}")
        counts = (*self.prompt_lengths, *self.concurrency, *self.long_concurrency, self.prefill_repeats,
                  self.prefill_output, self.decode_prompt, self.decode_output, self.open_requests,
                  *self.open_prompt, *self.open_output)  # fmt: skip
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in counts) or self.long_prompt < 0:
            raise ValueError("plan lengths, counts and concurrencies must be integers >= 1")
        if any(not rate > 0 for rate in self.open_rates):
            raise ValueError(f"open rates must be > 0 (fractions of capacity), got {self.open_rates}")
        if self.open_prompt[0] > self.open_prompt[1] or self.open_output[0] > self.open_output[1]:
            raise ValueError("open prompt and output ranges must be LOW,HIGH with LOW <= HIGH")

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class PlannedRun:
    name: str
    kind: str  # a phase
    params: dict[str, Any]
    requests: tuple[BenchRequest, ...]
    max_concurrency: int | None  # 1: one at a time; None: all at their send times


def _requests(tag: str, count: int, prompt: int, output: int, seed: int) -> tuple[BenchRequest, ...]:
    ids = [f"{tag}-{i}" for i in range(count)]
    return tuple(BenchRequest(rid, 0.0, prompt_text(prompt, seed, rid), prompt, output) for rid in ids)


SPEED_PROBE_PROMPT, SPEED_PROBE_OUTPUT = 32, 24


def speed_probe_run(index: int) -> PlannedRun:
    """The `index`-th speed probe: one request of a fixed shape, alone (`contbatch.observe.probe`)."""
    rid = f"speed-probe-{index}"
    request = BenchRequest(rid, 0.0, prompt_text(SPEED_PROBE_PROMPT, 0, "speed-probe"), SPEED_PROBE_PROMPT,
                           SPEED_PROBE_OUTPUT)  # fmt: skip
    return PlannedRun(rid, "warmup", {}, (request,), 1)


def closed_runs(config: PlanConfig) -> list[PlannedRun]:
    """The warm-up, prefill and decode runs the config's phases ask for, in that order."""
    runs: list[PlannedRun] = []
    s = config.seed
    if "warmup" in config.phases:
        runs.append(PlannedRun("warmup", "warmup", {"concurrency": 2}, _requests("warmup", 4, 64, 16, s), 2))
    if "prefill" in config.phases:
        for p in config.prompt_lengths:
            params = {"prompt": p, "output": config.prefill_output, "repeats": config.prefill_repeats}
            requests = _requests(f"prefill-p{p}", config.prefill_repeats, p, config.prefill_output, s)
            runs.append(PlannedRun(f"prefill-p{p}", "prefill", params, requests, 1))
    if "open" in config.phases:
        runs.append(saturation_run(config))
    if "decode" in config.phases:
        sweeps = [(config.decode_prompt, config.concurrency)]
        if config.long_prompt:
            sweeps.append((config.long_prompt, config.long_concurrency))
        for prompt, counts in sweeps:
            for n in counts:
                name = f"decode-n{n}-p{prompt}"
                params = {"concurrency": n, "prompt": prompt, "output": config.decode_output}
                runs.append(
                    PlannedRun(name, "decode", params, _requests(name, n, prompt, config.decode_output, s), None)
                )
    return runs


def _open_trace(config: PlanConfig, rate: float, seed: int) -> Trace:
    trace = synthetic_trace(
        config.open_requests, request_rate=rate, input_len=sum(config.open_prompt) // 2,
        output_len=sum(config.open_output) // 2, range_ratio=_ratio(config.open_prompt), seed=seed,
    )  # fmt: skip
    return _output_range(trace, config.open_output, seed)


def saturation_run(config: PlanConfig) -> PlannedRun:
    """The open runs' requests all at once: the server's capacity for that mix is its request
    throughput here (`estimate_capacity`), and the run is a mixed prefill-decode run to fit on."""
    seed = config.seed + 1000
    trace = _open_trace(config, math.inf, seed)
    return PlannedRun("saturation", "decode", {"saturation": True}, tuple(from_trace(trace, seed=seed)), None)


def open_runs(config: PlanConfig, capacity_rps: float) -> list[PlannedRun]:
    """One open-loop run per rate fraction: Poisson arrivals at fraction x `capacity_rps`."""
    if "open" not in config.phases:
        return []
    runs = []
    for i, fraction in enumerate(config.open_rates):
        rate = fraction * capacity_rps
        trace = _open_trace(config, rate, config.seed + i)
        name = f"open-{fraction:.2f}"
        params = {"rate_fraction": fraction, "rate_rps": rate, "capacity_rps": capacity_rps}
        runs.append(PlannedRun(name, "open", params, tuple(from_trace(trace, seed=config.seed + i)), None))
    return runs


def _ratio(bounds: tuple[int, int]) -> float:
    low, high = bounds
    middle = (low + high) / 2
    return (high - low) / (low + high) if middle else 0.0


def _output_range(trace: Trace, bounds: tuple[int, int], seed: int) -> Trace:
    """`synthetic_trace` gives prompt and output one ratio; the outputs get their own range here."""
    rng = random.Random(f"{seed}/outputs")
    requests = tuple(dataclasses.replace(r, num_output_tokens=rng.randint(*bounds)) for r in trace.requests)
    return dataclasses.replace(trace, requests=requests)


def estimate_capacity(runs: Sequence[ObservedRun], prompt: float, output: float) -> float | None:
    """Requests per second the server sustains for requests of `prompt` and `output` tokens
    (means): the completed requests over the makespan of the ``saturation`` run when there is
    one; else, from the prefill and decode runs, 1 / (prompt x prefill seconds per token + output /
    decode tokens per second at the largest observed batch), an optimistic bound. None without."""
    saturated = [run for run in runs if run.name == "saturation" and len(run.completed) >= 2]
    if saturated:
        done = saturated[0].completed
        span = max(r.end_ts for r in done) - min(r.send_ts for r in done)
        return len(done) / span if span > 0 else None
    prefill = [(r.num_prompt_tokens, r.chunk_ts[0] - r.send_ts) for run in runs if run.kind == "prefill"
               for r in run.completed]  # fmt: skip
    decode = [run for run in runs if run.kind == "decode" and len(run.completed) >= 1]
    if len({p for p, _ in prefill}) < 2 or not decode:
        return None
    slope = max(_slope(prefill), 0.0)
    widest = max(decode, key=lambda run: (len(run.completed), -int(run.params.get("prompt", 0))))
    gaps = [b - a for r in widest.completed for a, b in zip(r.chunk_ts, r.chunk_ts[1:], strict=False)]
    tokens_per_chunk = statistics.fmean(n for r in widest.completed for n in r.chunk_tokens)
    if not gaps:
        return None
    step = max(statistics.median(gaps) / tokens_per_chunk, 1e-6)
    decode_rate = len(widest.completed) / step  # tokens per second at that batch
    return 1.0 / (prompt * slope + output / decode_rate)


def _slope(points: Sequence[tuple[float, float]]) -> float:
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    num = sum((x - mean_x) * (y - mean_y) for x, y in points)
    den = sum((x - mean_x) ** 2 for x, _ in points)
    return num / den if den else 0.0
