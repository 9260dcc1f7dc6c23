"""The fit by steps on observations the simulator produced, then timed wrong as a loaded client reads
them: a few prefill steps read far too short or too long must not move the step terms.

On a loaded 2-core machine, `contbatch serve --backend sim` observed over HTTP gave steps read at a
third of their length (the client read the chunks of the step before late, this step's on time),
and the plain least squares priced a 768-token prefill 51 % (in CI once 75 %) too cheap
(`test_observe_sim_server`). Three such late reads in the open run of `probe_runs` leave it no
prefill term at all.
"""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.observe.fit import DELIVERY, _robust_solve, fit, step_samples
from contbatch.observe.record import ObservedRun
from contbatch.observe.replay import NUM_STEP_TERMS, Sample
from contbatch.observe.steps import clusters, timed_steps
from tests.observe.test_fit_math import CONFIG, TRUE, probe_runs

BUDGET = CONFIG.max_num_batched_tokens


def read_late(run: ObservedRun, cluster: int, fraction: float) -> ObservedRun:
    """`run` with the chunks of its `cluster`-th step read late by `fraction` of the next step:
    the step ending there reads that much longer, the next one that much shorter."""
    found = clusters(run)
    delay = fraction * (found[cluster + 1].first_ts - found[cluster].first_ts)
    requests = list(run.requests)
    for i, k in found[cluster].members.items():
        r = requests[i]
        chunk_ts = tuple(ts + delay if n == k else ts for n, ts in enumerate(r.chunk_ts))
        requests[i] = dataclasses.replace(r, chunk_ts=chunk_ts, end_ts=max(r.end_ts, chunk_ts[-1]))
    return dataclasses.replace(run, requests=tuple(requests))


def prefill_pairs(run: ObservedRun, count: int) -> list[int]:
    """The first `count` timed prefill steps of `run` whose next step is a timed prefill step too,
    no two sharing a step."""
    prefills = [s.out.step_id for s in timed_steps(run, BUDGET) if s.out.num_prefill_tokens]
    found: list[int] = []
    for j in prefills:
        if j + 1 in prefills and (not found or j > found[-1] + 1) and len(found) < count:
            found.append(j)
    return found


def test_a_few_prefill_steps_read_late_leave_the_step_terms() -> None:
    runs = probe_runs()
    corrupted = runs[-1]
    pairs = prefill_pairs(corrupted, 3)
    for j in pairs:
        corrupted = read_late(corrupted, j, 0.7)  # prefill step j reads ~1.7x, prefill step j + 1 0.3x
    prefills = [s for s in timed_steps(corrupted, BUDGET) if s.out.num_prefill_tokens]
    assert len(pairs) == 3 and len(prefills) > 20  # six of them timed wrong
    result = fit([*runs[:-1], corrupted], CONFIG)
    assert result.method == "steps"
    assert result.terms.theta[:NUM_STEP_TERMS] == pytest.approx(TRUE.theta[:NUM_STEP_TERMS], rel=0.02)


def swapped(samples: list[Sample], a: int, b: int) -> None:
    """Swap the durations of steps `a` and `b` in place, each weighted by its new duration as
    `step_samples` weighs them."""
    first, second = samples[a], samples[b]
    samples[a] = dataclasses.replace(
        first, observed=second.observed, weight=first.weight * first.observed / second.observed
    )
    samples[b] = dataclasses.replace(
        second, observed=first.observed, weight=second.weight * second.observed / first.observed
    )


def test_swapped_prefill_durations_leave_the_step_terms() -> None:
    samples = step_samples(probe_runs(), CONFIG)
    prefills = sorted((i for i, s in enumerate(samples) if s.features[1]), key=lambda i: samples[i].features[1])
    for n in range(3):  # the three shortest prompts with three of the longest
        swapped(samples, prefills[n], prefills[-1 - n])
    solved = _robust_solve(samples, {DELIVERY: 0.0})
    assert solved[:NUM_STEP_TERMS] == pytest.approx(TRUE.theta[:NUM_STEP_TERMS], rel=0.02)
