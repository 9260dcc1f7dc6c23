"""Streaming mode (`simulate(..., keep_timelines=False)`) keeps no timelines and gives exactly the
summary that the full timelines give."""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.core import PRESETS, ContinuousScheduler, StaticScheduler
from contbatch.metrics import SLO
from contbatch.sim import AffineCost, simulate
from contbatch.traces import load_trace


@pytest.mark.parametrize("name", ["kv-pressure", "multi-tenant", "long-prompt", "prefix-share"])
@pytest.mark.parametrize("scheduler_cls", [ContinuousScheduler, StaticScheduler])
def test_streaming_summary_equals_the_full_one(name: str, scheduler_cls: type[ContinuousScheduler]) -> None:
    trace = load_trace(name)
    config = dataclasses.replace(PRESETS["engine"], max_num_seqs=64)
    slo = SLO(ttft=1.0, tpot=0.05)
    full = simulate(trace, scheduler_cls(config), AffineCost())
    streamed = simulate(trace, scheduler_cls(config), AffineCost(), keep_timelines=False)
    assert streamed.timelines == () and streamed.streaming is not None
    assert len(streamed.streaming) == len(trace)
    assert streamed.summary(slo) == full.summary(slo)
    assert streamed.run_stats() == full.run_stats()


def test_streaming_refuses_client_models() -> None:
    with pytest.raises(ValueError, match="streaming mode"):
        simulate(load_trace("cancel-storm"), ContinuousScheduler(PRESETS["engine"]), AffineCost(), keep_timelines=False)
