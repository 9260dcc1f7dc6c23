"""The simulator's loop makes no reference cycles (so pausing the cyclic garbage collector while
it runs, `contbatch.sim.no_cycles`, loses nothing), nor does its summary, and the collector's
state is restored."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.core import ContinuousScheduler, SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.sim import parse_cost, simulate
from contbatch.sim.no_cycles import cyclic_gc_paused
from contbatch.traces import Trace

from .test_skip_ahead import COSTS, _fits, configs, traces


def _unreachable_after(run: object) -> int:
    """Objects a cyclic collection finds unreachable after `run()`, among those made since it
    began: what existed before is frozen (`gc.freeze`), so the collection scans only the run's
    objects (a full one over a test worker's millions took most of this file's time)."""
    gc.freeze()
    try:
        run()  # type: ignore[operator]
        return gc.collect()
    finally:
        gc.unfreeze()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(trace=traces(), config=configs(), cost_name=st.sampled_from(sorted(COSTS)), skip_ahead=st.booleans())
def test_a_simulation_leaves_nothing_for_the_cyclic_collector(
    trace: Trace, config: SchedulerConfig, cost_name: str, skip_ahead: bool
) -> None:
    trace = _fits(trace, config)
    cost = COSTS[cost_name]

    def run() -> None:
        for keep in (True, False) if not any(r.cancel_ts or r.read_rate for r in trace.requests) else (True,):
            simulate(trace, ContinuousScheduler(config), cost, skip_ahead=skip_ahead, keep_timelines=keep).summary()

    assert _unreachable_after(run) == 0


def test_prefix_caching_and_swapping_leave_nothing_either() -> None:
    from contbatch.traces.synthetic import fixed, generate, poisson

    trace = generate("cycles", 300, poisson(40.0), fixed(300), fixed(60), seed=3)
    kv = KVConfig(block_size=16, num_blocks=400, enable_prefix_caching=True, preemption="swap", num_host_blocks=200)
    config = SchedulerConfig(max_num_batched_tokens=512, kv=kv)
    cost = parse_cost("roofline:llama-2-7b@a100")
    assert _unreachable_after(lambda: simulate(trace, ContinuousScheduler(config), cost).summary()) == 0


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collectors_state_is_restored_even_on_an_exception(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), cyclic_gc_paused():
            raise RuntimeError("boom")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
