"""Synthetic generators: determinism, independent streams, the right means, scale_to_rate."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Callable

import pytest

from contbatch.traces import Trace, TraceRequest
from contbatch.traces.synthetic import (
    ArrivalProcess,
    LengthDistribution,
    constant,
    fixed,
    gamma,
    generate,
    lognormal,
    mean_rate,
    poisson,
    resample,
    scale_to_rate,
    substream,
    uniform,
)

NUM_DRAWS = 5000


def _gaps(trace: Trace) -> list[float]:
    arrivals = [r.arrival_ts for r in trace]
    return [b - a for a, b in itertools.pairwise(arrivals)]


def _cv2(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pvariance(values, mean) / mean**2


def _lengths(distribution: LengthDistribution, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [distribution.sample(rng) for _ in range(NUM_DRAWS)]


def test_generate_is_deterministic_for_a_seed() -> None:
    def make(seed: int) -> Trace:
        return generate("t", 200, gamma(3.0, 2.0), lognormal(300, 1.0, 1, 4000), uniform(1, 500), seed=seed)

    assert make(1) == make(1)
    assert make(1).requests != make(2).requests


def test_streams_are_independent() -> None:
    a = generate("t", 100, poisson(2.0), uniform(1, 100), uniform(1, 100), seed=3)
    b = generate("t", 100, poisson(2.0), uniform(1, 100), fixed(9), seed=3)
    assert [(r.arrival_ts, r.num_prompt_tokens) for r in a] == [(r.arrival_ts, r.num_prompt_tokens) for r in b]
    assert {r.num_output_tokens for r in b} == {9}
    assert substream(3, "x").random() == substream(3, "x").random() != substream(3, "y").random()


@pytest.mark.parametrize(
    "process", [poisson(5.0), gamma(5.0, 0.25), gamma(5.0, 1.0), gamma(5.0, 4.0), constant(5.0), poisson(0.01)]
)
def test_arrival_rate_within_ten_percent(process: ArrivalProcess) -> None:
    trace = generate("t", NUM_DRAWS, process, fixed(1), fixed(1), seed=11)
    assert mean_rate(trace) == pytest.approx(process.rate, rel=0.10)


@pytest.mark.parametrize(("process", "cv2"), [(poisson(2.0), 1.0), (constant(2.0), 0.0)])
def test_cv2_of_poisson_and_constant(process: ArrivalProcess, cv2: float) -> None:
    gaps = _gaps(generate("t", NUM_DRAWS, process, fixed(1), fixed(1), seed=5))
    assert _cv2(gaps) == pytest.approx(cv2, abs=0.1)


def test_gamma_with_burstiness_one_is_poisson() -> None:
    def make(process: ArrivalProcess) -> Trace:
        return generate("t", 100, process, fixed(1), fixed(1), seed=2)

    # The same draws (gamma of shape 1 is an exponential), up to the last bit of 1/rate.
    gamma_arrivals = [r.arrival_ts for r in make(gamma(3.0, 1.0))]
    assert gamma_arrivals == pytest.approx([r.arrival_ts for r in make(poisson(3.0))], rel=1e-12)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 2.0, 4.0])
def test_gamma_cv2_near_burstiness(burstiness: float) -> None:
    # The sample CV² of 5,000 gamma gaps has a relative spread of ~7 % at burstiness 4 (kurtosis 27).
    gaps = _gaps(generate("t", NUM_DRAWS, gamma(2.0, burstiness), fixed(1), fixed(1), seed=5))
    assert _cv2(gaps) == pytest.approx(burstiness, rel=0.2)


def test_first_arrival_is_zero_and_ids_follow_arrivals() -> None:
    trace = generate("load", 4, constant(2.0), fixed(3), fixed(2), seed=0, time_unit="tick")
    assert trace.requests == tuple(TraceRequest(f"load-{i}", i / 2, 3, 2) for i in range(4))
    assert (trace.name, trace.time_unit) == ("load", "tick")
    assert trace.source == (
        "synthetic (contbatch.traces.synthetic, seed 0): 4 requests, arrivals constant(rate=2), "
        "prompts fixed(3), outputs fixed(2)"
    )
    assert generate("x", 1, poisson(1.0), fixed(1), fixed(1), seed=0, source="mine").source == "mine"


def test_until_bounds_the_arrivals() -> None:
    trace = generate("t", None, constant(4.0), fixed(1), fixed(1), seed=0, until=10.0)
    assert len(trace) == 40
    assert trace.duration == pytest.approx(9.75)
    assert "40 requests before 10 s" in trace.source
    assert len(generate("t", 7, constant(4.0), fixed(1), fixed(1), seed=0, until=10.0)) == 7
    capped = generate("t", None, poisson(4.0), fixed(1), fixed(1), seed=9, until=60.0)
    assert capped.requests == generate("t", 1000, poisson(4.0), fixed(1), fixed(1), seed=9).requests[: len(capped)]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_requests": None}, "num_requests, until, or both"),
        ({"num_requests": 0}, "num_requests"),
        ({"until": 0.0}, "until"),
        ({"until": math.inf}, "until"),
        ({"time_unit": "ms"}, "time_unit"),
    ],
)
def test_generate_rejects(kwargs: dict[str, object], fragment: str) -> None:
    values: dict[str, object] = {"num_requests": 5, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=fragment):
        generate("t", arrivals=poisson(1.0), prompt_lengths=fixed(1), output_lengths=fixed(1), **values)  # type: ignore[arg-type]


def test_fixed_and_uniform() -> None:
    assert set(_lengths(fixed(17))) == {17}
    draws = _lengths(uniform(10, 30))
    assert (min(draws), max(draws)) == (10, 30)
    assert statistics.fmean(draws) == pytest.approx(20, rel=0.10)
    assert set(_lengths(uniform(5, 5))) == {5}


def test_lognormal_median_and_clamping() -> None:
    draws = _lengths(lognormal(500, 0.8, 1, 100_000))
    assert statistics.median(draws) == pytest.approx(500, rel=0.10)
    clamped = _lengths(lognormal(500, 2.0, 100, 1000))
    assert (min(clamped), max(clamped)) == (100, 1000)
    assert statistics.median(clamped) == pytest.approx(500, rel=0.10)  # clamping keeps the median
    assert set(_lengths(lognormal(1e300, 5.0, 1, 9))) == {9}  # huge draws clamp, never overflow


def test_resample_draws_from_the_values() -> None:
    values = [1, 1, 1, 50, 400]
    draws = _lengths(resample(values))
    assert set(draws) == set(values)
    assert statistics.fmean(draws) == pytest.approx(statistics.fmean(values), rel=0.10)
    assert draws.count(1) / NUM_DRAWS == pytest.approx(0.6, abs=0.05)
    assert str(resample(values)) == "resample(5 values, mean 90.6)"


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: poisson(0.0), "rate"),
        (lambda: poisson(math.nan), "rate"),
        (lambda: constant(-1.0), "rate"),
        (lambda: gamma(1.0, 0.0), "burstiness"),
        (lambda: gamma(1.0, math.inf), "burstiness"),
        (lambda: poisson(10**400), "rate"),
        (lambda: fixed(0), "num_tokens"),
        (lambda: fixed(2.0), "num_tokens"),  # type: ignore[arg-type]
        (lambda: uniform(5, 4), "hi must be >= lo"),
        (lambda: uniform(0, 4), "lo"),
        (lambda: lognormal(0.0, 1.0, 1, 2), "median"),
        (lambda: lognormal(5.0, -1.0, 1, 2), "sigma"),
        (lambda: lognormal(5.0, 1.0, 3, 2), "hi must be >= lo"),
        (lambda: resample([]), "empty"),
        (lambda: resample([3, 0]), r"values\[1\]"),
        (lambda: resample([True]), r"values\[0\]"),
    ],
)
def test_distributions_reject(make: Callable[[], object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        make()


def test_distribution_names_are_their_calls() -> None:
    assert str(gamma(2.5, 4)) == "gamma(rate=2.5, burstiness=4)"
    assert str(lognormal(300, 1.5, 1, 4096)) == "lognormal(median=300, sigma=1.5, lo=1, hi=4096)"
    assert str(uniform(1, 9)) == "uniform(1, 9)"


def test_scale_to_rate() -> None:
    requests = (
        TraceRequest("a", 1.0, 4, 5, deadline_ts=3.0, priority=2),
        TraceRequest("b", 2.0, 4, 5, cancel_ts=2.5, tenant="t", read_rate=3.0),
        TraceRequest("c", 2.0, 4, 5, max_output_tokens=9, prefix_group="g", prefix_tokens=2),
        TraceRequest("d", 5.0, 4, 5),
    )
    trace = Trace(name="t", requests=requests, time_unit="s", source="hand made")
    assert mean_rate(trace) == 0.75  # 3 gaps over 4 s
    scaled = scale_to_rate(trace, 1.5)
    assert mean_rate(scaled) == 1.5
    assert [r.request_id for r in scaled] == ["a", "b", "c", "d"]
    assert [r.arrival_ts for r in scaled] == [0.5, 1.0, 1.0, 2.5]
    assert scaled.requests[0] == TraceRequest("a", 0.5, 4, 5, deadline_ts=2.5, priority=2)
    assert scaled.requests[1] == TraceRequest("b", 1.0, 4, 5, cancel_ts=1.5, tenant="t", read_rate=3.0)
    assert scaled.requests[2] == TraceRequest("c", 1.0, 4, 5, max_output_tokens=9, prefix_group="g", prefix_tokens=2)
    assert (scaled.name, scaled.time_unit) == ("t", "s")
    assert scaled.source == "hand made; arrival times x0.5 to a mean rate of 1.5 per s"


def test_scale_to_rate_of_a_generated_trace() -> None:
    trace = generate("t", 1000, gamma(3.0, 2.0), fixed(1), fixed(1), seed=4)
    scaled = scale_to_rate(trace, 10.0)
    assert mean_rate(scaled) == pytest.approx(10.0, rel=1e-12)
    assert [r.request_id for r in scaled] == [r.request_id for r in trace]


@pytest.mark.parametrize(
    ("requests", "rate", "fragment"),
    [
        ((TraceRequest("a", 1.0, 1, 1),), 1.0, "two distinct arrival times"),
        ((TraceRequest("a", 1.0, 1, 1), TraceRequest("b", 1.0, 1, 1)), 1.0, "two distinct arrival times"),
        ((TraceRequest("a", 0.0, 1, 1), TraceRequest("b", 1.0, 1, 1)), 0.0, "rate"),
    ],
)
def test_scale_to_rate_rejects(requests: tuple[TraceRequest, ...], rate: float, fragment: str) -> None:
    trace = Trace(name="t", requests=requests, time_unit="s", source="x")
    with pytest.raises(ValueError, match=fragment):
        scale_to_rate(trace, rate)
