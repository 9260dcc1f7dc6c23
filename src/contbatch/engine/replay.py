"""`replay`: a trace sent to the real engine in real time, the measured side of `contbatch run`
and of calibration.

Each request is sent when its arrival time (relative to the start) has come, checked between
engine steps (a running step is never interrupted, as in the simulator), with random prompt
token ids of its length and its output length forced (greedy, EOS ignored). Invariant: the
returned timelines are the engine's own, shifted so that the trace starts at 0; every event is
kept, preemptions included.
"""

from __future__ import annotations

import random
import time

from contbatch.core import Timeline
from contbatch.core.timeline import EventKind
from contbatch.engine.llm_engine import LLMEngine
from contbatch.loop.params import SamplingParams
from contbatch.traces import Trace


def replay(engine: LLMEngine, trace: Trace, *, seed: int = 0) -> list[Timeline]:
    """Run `trace` on `engine` until every request finishes; one timeline per request, in
    trace order, on a clock that starts at 0."""
    rng = random.Random(seed)
    vocab = engine.runner.spec.vocab_size
    start = time.monotonic()
    sent = []
    pending = list(trace.requests)
    while pending or engine.has_unfinished():
        now = time.monotonic()
        while pending and start + pending[0].arrival_ts <= now:
            spec = pending.pop(0)
            prompt = [rng.randrange(3, vocab) for _ in range(spec.num_prompt_tokens)]
            params = SamplingParams(temperature=0.0, max_tokens=spec.num_output_tokens, ignore_eos=True)
            sent.append(
                engine.add_request(prompt, params, request_id=spec.request_id, arrival_ts=start + spec.arrival_ts)
            )
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, start + pending[0].arrival_ts - time.monotonic()))
    return [shifted(r.timeline, start) for r in sent]


def shifted(tl: Timeline, offset: float) -> Timeline:
    """A copy of `tl` with every timestamp moved back by `offset`, event for event."""
    moved = Timeline(
        tl.request_id,
        tl.arrival_ts - offset,
        tl.num_prompt_tokens,
        tenant=tl.tenant,
        priority=tl.priority,
        deadline_ts=None if tl.deadline_ts is None else tl.deadline_ts - offset,
    )
    for event in tl.events():
        ts = event.ts - offset
        if event.kind is EventKind.SCHEDULED:
            moved.record_scheduled(ts)
        elif event.kind is EventKind.PREEMPTED:
            moved.record_preempted(ts)
        elif event.kind is EventKind.TOKENS:
            moved.record_tokens(ts, event.num_tokens)
        elif event.kind is EventKind.FINISHED and event.reason is not None:
            moved.record_finished(ts, event.reason)
    return moved
