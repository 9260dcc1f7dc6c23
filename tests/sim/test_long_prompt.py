"""Chunked prefill against head-of-line blocking on the built-in `long-prompt` trace.

Under the unit cost model (C token-work per tick) a step costs ceil(tokens / C) ticks. Without
chunking, every prompt runs whole: each short prompt makes its step several ticks long and the
8,000-token prompt stalls every running decode for 126 ticks. With chunking under a budget of C,
no step exceeds one tick, so the short requests' inter-token latency is one tick throughout.
"""

from __future__ import annotations

import dataclasses

from contbatch.core import PRESETS, ContinuousScheduler
from contbatch.metrics import summarize
from contbatch.sim import UnitCost, simulate
from contbatch.traces import load_trace
from contbatch.traces.synthetic import scale_to_rate

CAPACITY = 64


def _short_itl(**overrides: object) -> dict[str, object]:
    trace = dataclasses.replace(scale_to_rate(load_trace("long-prompt"), 0.02), time_unit="tick")
    config = dataclasses.replace(PRESETS["engine"], **overrides)
    result = simulate(trace, ContinuousScheduler(config), UnitCost(CAPACITY))
    short = [t for t in result.timelines if t.request_id != "long"]
    assert len(short) == len(trace) - 1
    return summarize(short, time_unit="tick")


def test_chunked_prefill_lowers_the_short_requests_p99_itl() -> None:
    whole = _short_itl(chunked_prefill=False, max_num_batched_tokens=16384)
    chunked = _short_itl(chunked_prefill=True, max_num_batched_tokens=CAPACITY)
    assert whole["max_itl_ticks"] == 8000 // CAPACITY + 1  # the long prefill's stall
    assert whole["p99_itl_ticks"] >= 2  # short prefills stretch steps too
    assert chunked["p99_itl_ticks"] < whole["p99_itl_ticks"]
    assert round(chunked["max_itl_ticks"], 6) == 1
