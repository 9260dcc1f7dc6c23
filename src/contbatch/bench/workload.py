"""What the benchmark sends and when: one `BenchRequest` per trace request.

A workload comes from a trace (`contbatch.traces.load_trace`: a built-in or a file, replayed at
its own arrival times or rescaled to ``--request-rate``) or is synthetic
(`contbatch.traces.synthetic`: Poisson arrivals at ``--request-rate``, gamma arrivals with
``--burstiness``, every request at once for an infinite rate). ``max_tokens`` is the trace's
output length: the output is exactly that long when the server is told to ignore the end of
sequence (``--ignore-eos``, a vLLM extension), at most that long otherwise.

Prompts are built from short common English words (at most 4 bytes each), one word per prompt
token: most BPE tokenizers give one token per such word, and the sim backend's counting rule
(`contbatch.server.backends.sim`) gives exactly one. The words are drawn per request from a
seeded generator, so prompts differ (no accidental prefix sharing) and a run is reproducible.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from contbatch.traces import Trace, TraceError, load_trace
from contbatch.traces import synthetic as synth

_WORD_LIST = (
    "the of and to in is it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said use an each she do how if will up "
    "out many then them so some her make like him into time has look two more "
    "go see way who oil its now find long down day did get come made may part"
)
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    send_offset_s: float  # scheduled send time, seconds after the run starts
    prompt: str
    num_prompt_tokens: int  # intended; the server's usage says what it counted
    max_tokens: int  # the trace's output length (exact with ignore_eos, else at most)
    priority: int = 0
    tenant: str | None = None
    cancel_offset_s: float | None = None  # the client disconnects at this time, unless done


def prompt_text(num_tokens: int, seed: int, request_id: str) -> str:
    rng = random.Random(f"{seed}/prompt/{request_id}")
    return " ".join(rng.choice(WORDS) for _ in range(num_tokens))


def from_trace(trace: Trace, *, seed: int = 0) -> list[BenchRequest]:
    if trace.time_unit != "s":
        raise TraceError(f"trace {trace.name!r} is timed in {trace.time_unit} units; the benchmark needs seconds")
    return [
        BenchRequest(
            request_id=r.request_id,
            send_offset_s=r.arrival_ts,
            prompt=prompt_text(r.num_prompt_tokens, seed, r.request_id),
            num_prompt_tokens=r.num_prompt_tokens,
            max_tokens=r.num_output_tokens,
            priority=r.priority,
            tenant=r.tenant,
            cancel_offset_s=r.cancel_ts,
        )
        for r in trace.requests
    ]


def load(spec: str, *, request_rate: float | None) -> Trace:
    """A trace by name or path, rescaled to `request_rate` (requests/s) when given."""
    trace = load_trace(spec)
    if request_rate is None:
        return trace
    if math.isinf(request_rate):
        return _all_at_once(trace)
    return synth.scale_to_rate(trace, request_rate)


def synthetic_trace(
    num_prompts: int,
    *,
    request_rate: float,
    burstiness: float = 1.0,
    input_len: int = 256,
    output_len: int = 128,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> Trace:
    """`num_prompts` requests: Poisson (burstiness 1) or gamma arrivals at `request_rate`; lengths
    uniform in [len x (1 - range_ratio), len x (1 + range_ratio)]."""
    finite = not math.isinf(request_rate)
    rate = request_rate if finite else 1.0
    arrivals = synth.poisson(rate) if burstiness == 1.0 else synth.gamma(rate, burstiness)
    trace = synth.generate(
        "bench",
        num_prompts,
        arrivals,
        _lengths(input_len, range_ratio),
        _lengths(output_len, range_ratio),
        seed=seed,
    )
    return trace if finite else _all_at_once(trace)


def _lengths(center: int, ratio: float) -> synth.LengthDistribution:
    if ratio <= 0:
        return synth.fixed(center)
    lo = max(1, math.floor(center * (1 - ratio)))
    hi = max(lo, math.ceil(center * (1 + ratio)))
    return synth.uniform(lo, hi)


def _all_at_once(trace: Trace) -> Trace:
    requests = tuple(dataclasses.replace(r, arrival_ts=0.0, cancel_ts=None, deadline_ts=None) for r in trace.requests)
    return dataclasses.replace(trace, requests=requests)
