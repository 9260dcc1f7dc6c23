"""Seeded synthetic workloads: arrival processes, length distributions, `generate`, `scale_to_rate`.

Standard library only. Every draw comes from a `random.Random` stream named by the seed and a
purpose (`substream`), so a generator and a seed always give the same trace, on any platform and
under any ``PYTHONHASHSEED`` (``random.Random`` seeds a string through SHA-512, not ``hash``).

`generate` draws arrivals, prompt lengths and output lengths from three separate streams. Changing
one of the three therefore leaves the other two columns as they were: two traces that differ only
in their output distribution have the same arrival times and prompts, an A/B on one axis.

Arrival processes (`ArrivalProcess`) give inter-arrival gaps in the trace's time unit, mean 1/rate:

- `poisson(rate)`: exponential gaps, the coefficient of variation squared (CV²) is 1;
- `gamma(rate, burstiness)`: gamma gaps of shape 1/burstiness, so CV² = burstiness: 1 is Poisson,
  above 1 bursty, below 1 more regular than Poisson;
- `constant(rate)`: gaps of exactly 1/rate (CV² = 0).

The first request arrives at 0 and each later one a gap after the one before, so a trace of n
requests has n - 1 gaps and its mean rate (`mean_rate`) is (n - 1) / (last - first arrival).

Length distributions (`LengthDistribution`) give token counts >= 1: `fixed(n)`; `uniform(lo, hi)`
(integers, both ends included); `lognormal(median, sigma, lo, hi)` (a log-normal draw rounded to
an int, then clamped into [lo, hi], so the clamped tails pile up on the bounds); and
`resample(values)` (uniform draws from a list, e.g. a real trace's lengths).

Each distribution is a small frozen dataclass, validated on construction (ValueError), whose
``str`` is the call that makes it, e.g. ``poisson(rate=5)``; the default ``source`` of a
generated trace is built from these.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeGuard

from contbatch.traces.schema import TIME_UNITS, Trace, TraceRequest


class ArrivalProcess(Protocol):
    """Inter-arrival gaps with a mean of 1 / ``rate`` (requests per time unit)."""

    @property
    def rate(self) -> float: ...

    def sample(self, rng: random.Random) -> float:
        """The next gap, >= 0, in the trace's time unit."""
        ...


class LengthDistribution(Protocol):
    """Token counts (prompt or output lengths)."""

    def sample(self, rng: random.Random) -> int:
        """One token count, >= 1."""
        ...


@dataclass(frozen=True, slots=True)
class PoissonArrivals:
    rate: float  # requests per time unit; finite, > 0

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)

    def __str__(self) -> str:
        return f"poisson(rate={self.rate:g})"

    def sample(self, rng: random.Random) -> float:
        return rng.expovariate(self.rate)


@dataclass(frozen=True, slots=True)
class GammaArrivals:
    rate: float  # requests per time unit; finite, > 0
    burstiness: float  # CV² of the gaps = 1 / the gamma shape; finite, > 0; 1 is Poisson

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)
        _check_positive("burstiness", self.burstiness)

    def __str__(self) -> str:
        return f"gamma(rate={self.rate:g}, burstiness={self.burstiness:g})"

    def sample(self, rng: random.Random) -> float:
        # shape k = 1/b and scale b/rate: mean k * scale = 1/rate, variance k * scale² = b/rate².
        return rng.gammavariate(1.0 / self.burstiness, self.burstiness / self.rate)


@dataclass(frozen=True, slots=True)
class ConstantArrivals:
    rate: float  # requests per time unit; finite, > 0

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)

    def __str__(self) -> str:
        return f"constant(rate={self.rate:g})"

    def sample(self, rng: random.Random) -> float:
        return 1.0 / self.rate


@dataclass(frozen=True, slots=True)
class FixedLength:
    num_tokens: int  # >= 1

    def __post_init__(self) -> None:
        _check_count("num_tokens", self.num_tokens)

    def __str__(self) -> str:
        return f"fixed({self.num_tokens})"

    def sample(self, rng: random.Random) -> int:
        return self.num_tokens


@dataclass(frozen=True, slots=True)
class UniformLength:
    lo: int  # >= 1
    hi: int  # >= lo; both ends can be drawn

    def __post_init__(self) -> None:
        _check_bounds(self.lo, self.hi)

    def __str__(self) -> str:
        return f"uniform({self.lo}, {self.hi})"

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class LogNormalLength:
    median: float  # of the unclamped distribution; finite, > 0
    sigma: float  # standard deviation of the log; finite, >= 0
    lo: int  # >= 1; draws below are raised to lo
    hi: int  # >= lo; draws above are lowered to hi

    def __post_init__(self) -> None:
        _check_positive("median", self.median)
        if not (_is_number(self.sigma) and _finite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0, got {self.sigma!r}")
        _check_bounds(self.lo, self.hi)

    def __str__(self) -> str:
        return f"lognormal(median={self.median:g}, sigma={self.sigma:g}, lo={self.lo}, hi={self.hi})"

    def sample(self, rng: random.Random) -> int:
        draw = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.lo, round(min(draw, float(self.hi))))  # min() first: draw may be inf


@dataclass(frozen=True, slots=True)
class ResampledLength:
    values: tuple[int, ...]  # non-empty; each >= 1; drawn uniformly (repeats weigh more)

    def __post_init__(self) -> None:
        values = tuple(self.values)
        if not values:
            raise ValueError("values must not be empty")
        for index, value in enumerate(values):
            _check_count(f"values[{index}]", value)
        object.__setattr__(self, "values", values)

    def __str__(self) -> str:
        mean = sum(self.values) / len(self.values)
        return f"resample({len(self.values)} values, mean {mean:.1f})"

    def sample(self, rng: random.Random) -> int:
        return rng.choice(self.values)


def poisson(rate: float) -> PoissonArrivals:
    """Poisson arrivals: independent exponential gaps, ``rate`` requests per time unit."""
    return PoissonArrivals(rate)


def gamma(rate: float, burstiness: float) -> GammaArrivals:
    """Gamma-renewal arrivals with CV² = ``burstiness`` (1 = Poisson, > 1 bursty)."""
    return GammaArrivals(rate, burstiness)


def constant(rate: float) -> ConstantArrivals:
    """Evenly spaced arrivals, ``rate`` requests per time unit."""
    return ConstantArrivals(rate)


def fixed(n: int) -> FixedLength:
    """Always ``n`` tokens."""
    return FixedLength(n)


def uniform(lo: int, hi: int) -> UniformLength:
    """A uniform integer in [lo, hi]."""
    return UniformLength(lo, hi)


def lognormal(median: float, sigma: float, lo: int, hi: int) -> LogNormalLength:
    """A log-normal length with this median and log-sigma, rounded and clamped into [lo, hi]."""
    return LogNormalLength(median, sigma, lo, hi)


def resample(values: Iterable[int]) -> ResampledLength:
    """Uniform draws from ``values``, e.g. ``[r.num_output_tokens for r in load_trace("azure-code")]``."""
    return ResampledLength(tuple(values))


def substream(seed: int, purpose: str) -> random.Random:
    """The random stream for one ``purpose`` of a seeded generator, independent of the others."""
    return random.Random(f"{seed}/{purpose}")


def generate(
    name: str,
    num_requests: int | None,
    arrivals: ArrivalProcess,
    prompt_lengths: LengthDistribution,
    output_lengths: LengthDistribution,
    *,
    seed: int,
    time_unit: str = "s",
    source: str | None = None,
    until: float | None = None,
) -> Trace:
    """A synthetic trace: ids ``{name}-0``, ``{name}-1``, ... in arrival order, the first at 0.

    ``num_requests`` requests, or, with ``until``, the requests arriving before ``until``
    (``num_requests`` then caps them; None leaves ``until`` alone to decide). ``source``
    defaults to a line naming the generators and the seed.
    """
    _check_generate_args(num_requests, until, time_unit)
    arrival_ts = _arrival_times(arrivals, substream(seed, "arrivals"), num_requests, until)
    prompt_rng, output_rng = substream(seed, "prompts"), substream(seed, "outputs")
    requests = tuple(
        TraceRequest(f"{name}-{index}", ts, prompt_lengths.sample(prompt_rng), output_lengths.sample(output_rng))
        for index, ts in enumerate(arrival_ts)
    )
    if source is None:
        count = f"{len(requests)} requests" + ("" if until is None else f" before {until:g} {time_unit}")
        source = (
            f"synthetic (contbatch.traces.synthetic, seed {seed}): {count}, arrivals {arrivals}, "
            f"prompts {prompt_lengths}, outputs {output_lengths}"
        )
    return Trace(name=name, requests=requests, time_unit=time_unit, source=source)


def _check_generate_args(num_requests: int | None, until: float | None, time_unit: str) -> None:
    if num_requests is None and until is None:
        raise ValueError("give num_requests, until, or both")
    if num_requests is not None and (not isinstance(num_requests, int) or num_requests < 1):
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if until is not None:
        _check_positive("until", until)
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {', '.join(TIME_UNITS)}, got {time_unit!r}")


def _arrival_times(
    arrivals: ArrivalProcess, rng: random.Random, num_requests: int | None, until: float | None
) -> list[float]:
    times: list[float] = []
    now = 0.0
    while (num_requests is None or len(times) < num_requests) and (until is None or now < until):
        times.append(now)
        now += arrivals.sample(rng)
    return times


def mean_rate(trace: Trace) -> float:
    """Requests per time unit: (n - 1) gaps over the span from the first arrival to the last."""
    span = trace.requests[-1].arrival_ts - trace.requests[0].arrival_ts if trace.requests else 0.0
    if span <= 0:
        raise ValueError(f"trace {trace.name!r}: no mean rate without two distinct arrival times")
    return (len(trace) - 1) / span


def scale_to_rate(trace: Trace, rate: float) -> Trace:
    """``trace`` with every arrival time multiplied so that its `mean_rate` becomes ``rate``.

    Order is kept. Deadlines and cancel times keep their offset from the request's own arrival
    (a 5 s deadline stays 5 s); lengths and every other field are unchanged.
    """
    _check_positive("rate", rate)
    factor = mean_rate(trace) / rate
    requests = tuple(_rescaled(request, factor) for request in trace.requests)
    source = f"{trace.source}; arrival times x{factor:.6g} to a mean rate of {rate:g} per {trace.time_unit}"
    return dataclasses.replace(trace, requests=requests, source=source)


def _rescaled(request: TraceRequest, factor: float) -> TraceRequest:
    arrival_ts = request.arrival_ts * factor
    if request.deadline_ts is None and request.cancel_ts is None:  # (most requests: nothing else moves)
        return request.replace(arrival_ts=arrival_ts)

    def moved(ts: float | None) -> float | None:
        return None if ts is None else arrival_ts + (ts - request.arrival_ts)

    return request.replace(
        arrival_ts=arrival_ts, deadline_ts=moved(request.deadline_ts), cancel_ts=moved(request.cancel_ts)
    )


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_positive(field: str, value: object) -> None:
    if not (_is_number(value) and _finite(value) and value > 0):
        raise ValueError(f"{field} must be a finite number > 0, got {value!r}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_count(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{field} must be an integer >= 1, got {value!r}")


def _check_bounds(lo: int, hi: int) -> None:
    _check_count("lo", lo)
    _check_count("hi", hi)
    if hi < lo:
        raise ValueError(f"hi must be >= lo, got lo={lo!r}, hi={hi!r}")
