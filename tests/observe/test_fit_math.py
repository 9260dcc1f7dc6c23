"""The fit on observations the simulator itself produced (no HTTP): it recovers the cost exactly.

A trace simulated with a known affine cost gives per-chunk timelines; written as an observation
(each chunk `DELIVERY_MS` late, as an HTTP path would deliver it) and fitted under the same
scheduler config, the fixed point of `contbatch.observe.fit` is that cost and that delay.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from contbatch.core import SchedulerConfig, make_scheduler
from contbatch.core.config import PRESETS
from contbatch.core.status import FinishReason
from contbatch.observe.fit import Terms, _solve, fit, objective
from contbatch.observe.record import ObservedRequest, ObservedRun
from contbatch.observe.replay import linearise, replay
from contbatch.sim.cost import AffineCost
from contbatch.sim.loop import simulate
from contbatch.traces import Trace, TraceRequest

TRUE = Terms(
    base_ms=20.0,
    prefill_ms=0.1,
    decode_ms=1.0,
    context_ms=0.002,
    prefill_pair_ms=0.0002,
    batch_pair_ms=0.00003,
    delivery_ms=3.0,
)
CONFIG: SchedulerConfig = PRESETS["engine"]


def observed_run(name: str, kind: str, requests: list[TraceRequest], terms: Terms = TRUE) -> ObservedRun:
    trace = Trace(name, tuple(requests), "s", "test")
    result = simulate(trace, make_scheduler("continuous", CONFIG), terms.cost())
    delay = terms.delivery_ms / 1000
    out = []
    for t in result.timelines:
        chunks = tuple(ts + delay for ts in t.token_ts)
        assert t.finished_ts is not None
        out.append(ObservedRequest(t.request_id, t.arrival_ts, t.arrival_ts, t.num_prompt_tokens,
                                   t.num_output_tokens, chunks, tuple(t.token_counts), t.finished_ts + delay,
                                   FinishReason.LENGTH, 200))  # fmt: skip
    return ObservedRun(name, kind, {}, tuple(out))


def probe_runs() -> list[ObservedRun]:
    runs = [observed_run(f"prefill-p{p}", "prefill", [TraceRequest(f"p{p}", 0.0, p, 4)]) for p in (16, 256, 1024)]
    for n, p in ((1, 32), (8, 32), (4, 512)):
        requests = [TraceRequest(f"d{n}-{p}-{i}", 0.0, p, 64) for i in range(n)]
        runs.append(observed_run(f"decode-n{n}-p{p}", "decode", requests))
    rng = random.Random(0)
    arrivals = [0.0]
    for _ in range(29):
        arrivals.append(arrivals[-1] + rng.expovariate(6.0))
    mixed = [TraceRequest(f"o{i}", a, rng.randint(32, 512), rng.randint(8, 64)) for i, a in enumerate(arrivals)]
    runs.append(observed_run("open-0.50", "open", mixed))
    return runs


def test_linearisation_is_exact_at_the_simulated_terms() -> None:
    run = probe_runs()[-1]
    rep = replay(run, CONFIG, TRUE.cost())
    assert rep is not None
    samples = linearise(rep, TRUE.theta)
    assert samples and objective(samples, TRUE.theta) == pytest.approx(0.0, abs=1e-18)
    assert _solve(samples) == pytest.approx(TRUE.theta, rel=1e-6)


@pytest.mark.parametrize("method", ["steps", "chunks"])
def test_fit_recovers_the_cost_that_made_the_observations(method: str) -> None:
    result = fit(probe_runs(), CONFIG, method=method)
    assert result.terms.theta == pytest.approx(TRUE.theta, rel=1e-4)
    assert result.objective == pytest.approx(0.0, abs=1e-9)
    assert all(r.ttft_mean_abs_rel < 1e-6 for r in result.residuals)
    assert (len(result.iterations) == 1) == (method == "steps")  # steps: one simulation, for the delivery


def test_fit_from_a_far_start_reaches_the_same_terms() -> None:
    far = Terms(
        base_ms=60.0,
        prefill_ms=0.0,
        decode_ms=0.0,
        context_ms=0.0,
        prefill_pair_ms=0.0,
        batch_pair_ms=0.0,
        delivery_ms=0.0,
    )
    assert fit(probe_runs(), CONFIG, start=far, method="chunks").terms.theta == pytest.approx(TRUE.theta, rel=1e-3)


def test_fit_by_steps_falls_back_to_chunks_with_few_timed_steps() -> None:
    runs = [run for run in probe_runs() if run.kind == "prefill"]  # one request at a time: 3 steps each
    assert fit(runs, CONFIG).iterations == fit(runs, CONFIG, method="chunks").iterations


def test_an_unknown_fit_method_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fit method 'table'; known: steps, chunks"):
        fit(probe_runs(), CONFIG, method="table")


def test_the_cost_is_an_affine_cost() -> None:
    assert TRUE.cost() == AffineCost(20.0, 0.1, 1.0, 0.002, prefill_pair_ms=0.0002, batch_pair_ms=0.00003)


def test_prefill_token_pairs_count_causal_attention_of_prefill_chunks() -> None:
    from contbatch.core.outputs import ScheduledChunk, SchedulerOutput
    from contbatch.sim.cost import prefill_token_pairs

    chunks = (ScheduledChunk("a", 0, 4, True, True), ScheduledChunk("b", 10, 3, True, False),
              ScheduledChunk("c", 50, 1, False, True))  # fmt: skip
    out = SchedulerOutput(0, chunks, 8, 7, 1, 4 + 13 + 51, num_requests=3)
    assert prefill_token_pairs(out) == (4 * 5 // 2) + (3 * 10 + 3 * 4 // 2)  # the decode reads its context instead
    plain = AffineCost(base_ms=0, prefill_ms=0, decode_ms=0, context_ms=0, swap_ms_per_block=0)
    assert dataclasses.replace(plain, prefill_pair_ms=0.5).step_time(out) == pytest.approx(0.5 * 46 / 1000)


def test_batch_token_pairs_count_every_query_token_against_every_kv_position_read() -> None:
    from contbatch.core.outputs import ScheduledChunk, SchedulerOutput
    from contbatch.sim.cost import batch_token_pairs

    chunks = (ScheduledChunk("a", 0, 4, True, True), ScheduledChunk("c", 50, 1, False, True))
    out = SchedulerOutput(0, chunks, 5, 4, 1, 4 + 51, num_requests=2)
    assert batch_token_pairs(out) == 5 * 55  # the decode's query meets the prompt's positions too (dense mask)
    plain = AffineCost(base_ms=0, prefill_ms=0, decode_ms=0, context_ms=0, swap_ms_per_block=0)
    assert dataclasses.replace(plain, batch_pair_ms=0.5).step_time(out) == pytest.approx(0.5 * 275 / 1000)


def test_fit_prices_each_run_at_the_speed_its_probes_found() -> None:
    """Runs observed on a machine whose speed moved (x0.8 to x1.25, as their speed probes say)
    give the terms of the reference speed, the probes' geometric mean, exactly."""
    speeds = [0.8, 1.0, 1.25, 1.0, 0.8, 1.25, 1.0]
    runs = []
    for run, speed in zip(probe_runs(), speeds, strict=True):
        specs = [TraceRequest(r.request_id, r.send_ts, r.num_prompt_tokens, r.max_tokens) for r in run.requests]
        moved = observed_run(run.name, run.kind, specs, TRUE.scaled(speed))
        runs.append(dataclasses.replace(moved, params={"speed_probe_ms": [10.0 * speed, 10.0 * speed]}))
    result = fit(runs, CONFIG, method="chunks")
    assert result.speed_reference_ms == pytest.approx(10.0)
    assert result.terms.theta == pytest.approx(TRUE.theta, rel=1e-4)
    assert result.speeds["decode-n8-p32"] == pytest.approx(0.8)
