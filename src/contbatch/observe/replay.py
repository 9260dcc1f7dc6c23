"""An observed run in the simulator, and its chunk times as linear functions of the cost terms.

`run_trace` turns a run into a trace on the run's own clock: each request arrives when it was
sent, with the server's prompt count and the output length it observed (a request cut by the
client is replayed with its cancel time; one that finished without a chunk carrying text, its
tokens decoded to none, ran all the same: with its ``max_tokens`` when it stopped for length;
failed and rejected ones, which took no capacity we can see, are left out). `replay` simulates it
with an `AffineCost` and records every step.

The linearisation (`linearise`): in the simulation a step ends at ``e_j = a_j + sum over the
steps of its busy period up to j of cost(step)``, where ``a_j`` is the time that busy period
began (an arrival: constant in the cost terms) and ``cost(step) = phi(step) . theta`` with
``phi = (1, prefill + padding tokens, decode tokens, context positions, prefill token pairs,
batch token pairs) / 1000`` and ``theta``
the affine terms in ms. So, for the schedule the simulator chose, every chunk's predicted arrival
is ``c + Phi . theta + delivery`` with ``Phi`` the busy period's cumulative features: exact at the
``theta`` simulated, and exact nearby as long as the schedule does not change. `Sample` holds one
observed quantity (a TTFT, or a gap between two chunks) with its row: ``value = offset +
features . (theta, delivery)``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from contbatch.core import SchedulerConfig, make_scheduler
from contbatch.core.outputs import SchedulerOutput
from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.loop.observe import StepObserver, StepRecord
from contbatch.observe.record import COMPLETED, ObservedRequest, ObservedRun
from contbatch.sim.cost import AffineCost, batch_token_pairs, prefill_token_pairs
from contbatch.sim.loop import SimResult, simulate
from contbatch.traces import Trace, TraceRequest

NUM_TERMS = 7  # base, prefill, decode, context, prefill pairs, batch pairs (per step, ms) and delivery (per chunk, ms)
NUM_STEP_TERMS = NUM_TERMS - 1


def run_speeds(runs: Sequence[ObservedRun]) -> tuple[dict[str, float], float | None]:
    """(run name -> the machine's speed during it against the reference, the reference in ms).

    A run's probe value is the geometric mean of its ``speed_probe_ms`` (the probe before and
    after it, `contbatch.observe.probe`); the reference is the geometric mean over all the runs'
    probes; a speed of 1.1 means steps took 10 % longer than at the reference. Runs without
    probes run at speed 1; so do all without any probe (reference None)."""
    values = {run.name: probe_ms(run) for run in runs}
    found = [v for v in values.values() if v is not None]
    if not found:
        return {run.name: 1.0 for run in runs}, None
    reference = math.exp(statistics.fmean(math.log(v) for v in found))
    return {name: 1.0 if v is None else v / reference for name, v in values.items()}, reference


def probe_ms(run: ObservedRun) -> float | None:
    """The run's speed probe in ms: the geometric mean of the probes around it (None without)."""
    probes = run.params.get("speed_probe_ms")
    if not isinstance(probes, list) or not probes or not all(isinstance(v, int | float) and v > 0 for v in probes):
        return None
    return math.exp(statistics.fmean(math.log(v) for v in probes))


def run_trace(run: ObservedRun) -> Trace | None:
    """The run as a trace on its own clock (module docstring); None when nothing in it ran."""
    requests = []
    for r in run.requests:
        if r.completed:
            n = r.num_output_tokens
            requests.append(TraceRequest(r.request_id, max(r.send_ts, 0.0), max(r.num_prompt_tokens, 1), n,
                                         max_output_tokens=max(n, r.max_tokens)))  # fmt: skip
        elif r.finish in COMPLETED:  # it ran, but no chunk carried text (its tokens decoded to none)
            n = max(r.max_tokens, 1) if r.finish is FinishReason.LENGTH else 1
            requests.append(TraceRequest(r.request_id, max(r.send_ts, 0.0), max(r.num_prompt_tokens, 1), n))
        elif r.finish is FinishReason.CANCELLED:
            cancel = max(r.end_ts, r.send_ts, 0.0)
            requests.append(TraceRequest(r.request_id, max(r.send_ts, 0.0), max(r.num_prompt_tokens, 1),
                                         max(r.max_tokens, 1), cancel_ts=cancel))  # fmt: skip
    if not requests:
        return None
    return Trace(run.name, tuple(requests), "s", f"observed run {run.name}")


class _Steps(StepObserver):
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


@dataclass(frozen=True, slots=True)
class Replay:
    run: ObservedRun
    result: SimResult
    steps: tuple[StepRecord, ...]

    def timelines(self) -> dict[str, Timeline]:
        return {t.request_id: t for t in self.result.timelines}


def replay(run: ObservedRun, config: SchedulerConfig, cost: AffineCost, scheduler: str = "continuous") -> Replay | None:
    trace = run_trace(run)
    if trace is None:
        return None
    steps = _Steps()
    result = simulate(trace, make_scheduler(scheduler, config), cost, observers=[steps])
    return Replay(run, result, tuple(steps.records))


@dataclass(frozen=True, slots=True)
class Sample:
    """One observed quantity and its linear prediction (module docstring)."""

    run: str
    request_id: str
    kind: str  # "ttft" or "gap"
    observed: float  # seconds
    offset: float  # seconds: the prediction's part that does not move with theta
    features: tuple[float, ...]  # NUM_TERMS coefficients of theta (ms) giving seconds
    weight: float  # the sample's weight in the objective (fit docstring)
    start_ts: float = 0.0  # the observed time the quantity starts at: the send (TTFT), the earlier chunk (gap)

    def predicted(self, theta: Sequence[float]) -> float:
        return self.offset + sum(f * t for f, t in zip(self.features, theta, strict=True))


def step_features(out: SchedulerOutput) -> tuple[float, ...]:
    """``phi`` of a step (module docstring): its cost in seconds is ``phi . theta[:NUM_STEP_TERMS]``."""
    pairs = prefill_token_pairs(out) if out.num_prefill_tokens else 0
    return (1e-3, 1e-3 * (out.num_prefill_tokens + out.num_padding_tokens), 1e-3 * out.num_decode_tokens,
            1e-3 * out.num_context_tokens, 1e-3 * pairs, 1e-3 * batch_token_pairs(out))  # fmt: skip


def _cumulative(steps: Sequence[StepRecord]) -> list[tuple[float, ...]]:
    """Per step, the features summed over its busy period so far (a period starts after idle time)."""
    cumulative: list[tuple[float, ...]] = []
    prev_end = float("-inf")
    running: tuple[float, ...] = (0.0,) * NUM_STEP_TERMS
    for record in steps:
        phi = step_features(record.out)
        fresh = record.start_ts > prev_end + 1e-9
        running = phi if fresh else tuple(a + b for a, b in zip(running, phi, strict=True))
        cumulative.append(running)
        prev_end = record.end_ts
    return cumulative


def linearise(rep: Replay, theta: Sequence[float], speed: float = 1.0) -> list[Sample]:
    """The run's TTFT and gap samples at `theta` (the terms `rep` was simulated with, every step
    cost multiplied by `speed`: the machine's speed during the run, `run_speeds`)."""
    steps = sorted(rep.steps, key=lambda s: s.end_ts)
    ends = [s.end_ts for s in steps]
    cumulative = [tuple(speed * f for f in cum) for cum in _cumulative(steps)]
    timelines = rep.timelines()
    samples: list[Sample] = []
    for request in rep.run.completed:
        timeline = timelines.get(request.request_id)
        if timeline is None or timeline.num_output_tokens < request.num_output_tokens:
            continue
        emitted = _emission_ends(timeline, request)
        rows = [(cumulative[_step(ends, ts)], ts) for ts in emitted]
        samples += _request_samples(rep.run.name, request, rows, theta)
    return samples


def _emission_ends(timeline: Timeline, request: ObservedRequest) -> list[float]:
    """The simulated time of the last token of each observed chunk."""
    token_times: list[float] = []
    for ts, n in zip(timeline.token_ts, timeline.token_counts, strict=True):
        token_times += [ts] * n
    out = []
    count = 0
    for n in request.chunk_tokens:
        count += n
        out.append(token_times[count - 1])
    return out


def _step(ends: list[float], ts: float) -> int:
    i = bisect.bisect_left(ends, ts - 1e-9)
    return min(i, len(ends) - 1)


def _request_samples(
    run: str, request: ObservedRequest, rows: list[tuple[tuple[float, ...], float]], theta: Sequence[float]
) -> list[Sample]:
    def linear(cum: tuple[float, ...]) -> float:
        return sum(f * t for f, t in zip(cum, theta[:NUM_STEP_TERMS], strict=True))

    (cum0, ts0) = rows[0]
    ttft = request.chunk_ts[0] - request.send_ts
    # the predicted TTFT is ts0 + delivery - send; ts0 = (ts0 - linear(cum0)) + cum0 . theta
    first = Sample(run, request.request_id, "ttft", ttft, ts0 - linear(cum0) - request.send_ts,
                   (*cum0, 1e-3), 1.0 / max(ttft, 1e-4), request.send_ts)  # fmt: skip
    samples = [first]
    gaps = len(rows) - 1
    if gaps < 1:
        return samples
    tpot = (request.chunk_ts[-1] - request.chunk_ts[0]) / gaps
    weight = 1.0 / (max(tpot, 1e-4) * gaps**0.5)
    for (cum_a, ts_a), (cum_b, ts_b), y_a, y_b in zip(
        rows, rows[1:], request.chunk_ts, request.chunk_ts[1:], strict=False
    ):
        delta = tuple(b - a for a, b in zip(cum_a, cum_b, strict=True))
        offset = (ts_b - ts_a) - linear(delta)
        samples.append(Sample(run, request.request_id, "gap", y_b - y_a, offset, (*delta, 0.0), weight, y_a))
    return samples
