"""`fit`: the affine cost terms that make the simulator's per-chunk timelines match the observed ones.

The model: a step of the server costs ``base + prefill x (prefill + padding tokens) + decode x
decode tokens + context x KV positions read + prefill_pair x (prefill token, attended position)
pairs + batch_pair x (query token, KV position) pairs of the whole batch`` ms
(`contbatch.sim.cost.AffineCost`, the profile's ``affine`` fit; the prefill pairs are the
quadratic part of a long prompt's cost, `prefill_token_pairs`; the batch pairs that of a server
running one dense masked attention over its packed batch, `batch_token_pairs`), and every chunk reaches the
client ``delivery`` ms after the step that produced its last token ended (HTTP, serialisation,
the network: a latency the schedule never sees).

Two methods (`METHODS`):

- ``steps`` (the default): the server's steps read from the outside (`contbatch.observe.steps`:
  the chunks of one step arrive together, and a step's content is known when nothing was
  half-done in it) give the step terms directly, by the weighted least squares of their durations
  (each step's error relative to its predicted duration, every term >= 0, solved exactly as
  below: ``step_samples``), made robust to the steps a loaded client timed far off by
  iteratively reweighting with Tukey's bisquare (`_robust_solve`: on exact observations, the
  plain least squares). Then each run is simulated once, at the machine speed its own timed
  steps ran at against those terms (`step_totals`), and the delivery is the value that minimises
  ``J`` below with the step terms held (the same least squares over the delivery alone). The
  probes' speeds play no part. It needs `MIN_TIMED_STEPS` timed steps, else it is the other method.
- ``chunks``: the step terms and the delivery together, by matching every chunk time, as follows.

The objective, over the completed requests ``i`` of every run used::

    J(theta) = sum_i [ ((TTFT_i(theta) - TTFT_i) / TTFT_i)^2
                       + (1 / G_i) sum_g ((gap_ig(theta) - gap_ig) / TPOT_i)^2 ]

where ``TTFT_i(theta)`` and ``gap_ig(theta)`` (the time between consecutive chunks, ``G_i`` of
them) come from simulating the observed runs (`contbatch.observe.replay`: arrivals at the
observed send times, the observed prompt and output lengths, the server's scheduler config) and
``TPOT_i`` is the request's observed mean gap. Each request weighs the same: once for its TTFT
and once for its whole gap profile, each as a relative error (a gap's error is relative to the
request's TPOT, so the near-zero gap of two chunks read from one packet cannot dominate). In a
run sent all at once, the TTFTs and the gaps before every request has started have weight 0
(`steady`: the server's intake order, invisible from outside, decides them).

The minimisation starts from the probes' direct readings (`initial_terms`), fits the closed runs
(prefill grid, decode sweep: schedules that barely move with the terms) first, and from there
all runs. Each fit alternates two exact steps (a Gauss-Newton iteration whose Jacobian is exact):
simulate at ``theta_k``, which fixes the schedule and makes every prediction linear in theta
(`replay.linearise`); then solve that weighted least squares with every term >= 0 (exactly:
with seven terms every subset is solved and the best one without a negative term wins). It stops
when theta moves by less than 0.1 % or after `MAX_ITERATIONS`, and returns the iterate of lowest
simulated ``J`` (a schedule may flip between two iterates).

Machine drift (``chunks``): each run is simulated with every step term multiplied by the
machine's speed during it (`replay.run_speeds`, from the speed probe `observe` sends around every
run), so the terms are those of the machine at the reference speed (``speed_reference_ms`` in
the profile); `validate --observed --speed-source probe` prices a held-out run at the speed its
own probes found (its default: at the speed its own timed steps ran at).

Invariant: on a server that *is* the simulator with an affine cost and the same config
(`contbatch serve --backend sim`), both methods give that cost, up to the noise of the HTTP
path (`tests/observe`); on observations the simulator produced, exactly that cost.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from contbatch.core import SchedulerConfig
from contbatch.observe.record import ObservedRun
from contbatch.observe.replay import (
    NUM_STEP_TERMS,
    NUM_TERMS,
    Replay,
    Sample,
    linearise,
    replay,
    run_speeds,
    step_features,
)
from contbatch.observe.steps import step_totals, timed_steps
from contbatch.sim.cost import AffineCost
from contbatch.sim.costs.profile import whole_speed

TERMS = ("base_ms", "prefill_ms", "decode_ms", "context_ms", "prefill_pair_ms", "batch_pair_ms", "delivery_ms")
OBJECTIVE = (
    "sum over completed requests of ((predicted TTFT - observed) / observed)^2 + mean over the request's chunk "
    "gaps of ((predicted gap - observed) / observed mean gap)^2; predictions from simulating the observed runs; "
    "in runs sent all at once, TTFTs and the gaps before every request started are not fitted"
)
DELIVERY = TERMS.index("delivery_ms")
MAX_ITERATIONS = 12
METHODS = ("steps", "chunks")
MIN_TIMED_STEPS = 50  # fewer timed steps than this: `fit` by steps falls back to chunks
TOLERANCE = 1e-3
BISQUARE = 4.685  # Tukey's constant, in robust scales: a step timed further off than this weighs nothing
MAX_REWEIGHTS = 30


class FitError(ValueError):
    """The observations cannot support a fit (no completed request, no run to simulate)."""


@dataclass(frozen=True, slots=True)
class Terms:
    base_ms: float
    prefill_ms: float
    decode_ms: float
    context_ms: float
    prefill_pair_ms: float
    batch_pair_ms: float
    delivery_ms: float

    @property
    def theta(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in TERMS)

    def cost(self, swap_ms_per_block: float = 0.32) -> AffineCost:
        return AffineCost(self.base_ms, self.prefill_ms, self.decode_ms, self.context_ms, swap_ms_per_block,
                          self.prefill_pair_ms, self.batch_pair_ms)  # fmt: skip

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in TERMS}

    def scaled(self, speed: float) -> Terms:
        """The step terms at a machine `speed` times slower (delivery is no step's and stays)."""
        return dataclasses.replace(self, **{name: speed * getattr(self, name) for name in TERMS[:NUM_STEP_TERMS]})


@dataclass(frozen=True, slots=True)
class RunResidual:
    run: str
    kind: str
    num_requests: int
    ttft_observed_ms: float  # means over the run's completed requests
    ttft_predicted_ms: float
    tpot_observed_ms: float | None
    tpot_predicted_ms: float | None
    ttft_mean_abs_rel: float  # mean |predicted / observed - 1| per request
    gap_mean_abs_rel: float | None  # mean |gap error| / TPOT per gap

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class FitResult:
    terms: Terms
    objective: float  # J at `terms`, per request (J / requests)
    num_requests: int
    iterations: tuple[dict[str, Any], ...]  # each iterate: its terms and objective
    residuals: tuple[RunResidual, ...] = field(default_factory=tuple)
    speed_reference_ms: float | None = None  # the speed probe the terms are priced at (None: no probe)
    speeds: Mapping[str, float] = field(default_factory=dict)  # each run's machine speed against it
    method: str = "chunks"  # how the step terms were found (`METHODS`)
    num_timed_steps: int = 0  # the steps the ``steps`` method fitted them to


def _solve(samples: Sequence[Sample], fixed: Mapping[int, float] | None = None) -> tuple[float, ...]:
    """Weighted non-negative least squares of the linearised samples, exactly: every subset of the
    terms is solved unconstrained and the best solution with no negative term wins. The terms in
    `fixed` (index -> value) are held at their values; a term no sample depends on stays 0."""
    held = dict(fixed or {})
    x = np.array([s.features for s in samples])
    y = np.array([s.observed - s.offset for s in samples]) - x[:, list(held)] @ np.array(list(held.values()))
    w = np.array([s.weight for s in samples])
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale * w[:, None]
    target = y * w
    usable = [i for i in range(NUM_TERMS) if i not in held and np.abs(x[:, i]).max() > 0]
    best, best_cost = np.zeros(NUM_TERMS), float(target @ target)
    for subset in itertools.chain.from_iterable(itertools.combinations(usable, k) for k in range(1, len(usable) + 1)):
        columns = list(subset)
        solution, *_ = np.linalg.lstsq(xs[:, columns], target, rcond=None)
        if (solution < 0).any():
            continue
        residual = target - xs[:, columns] @ solution
        cost = float(residual @ residual)
        if cost < best_cost:
            best, best_cost = np.zeros(NUM_TERMS), cost
            best[columns] = solution
    best /= scale
    for index, value in held.items():
        best[index] = value
    return tuple(float(v) for v in best)


def _robust_solve(samples: Sequence[Sample], fixed: Mapping[int, float]) -> tuple[float, ...]:
    """`_solve` of timed steps (`step_samples`: durations, weighted as errors relative to the observed
    ones) made robust to steps timed wrong (`_reweighted`), from the plain solution: first with each
    step's error relative to its predicted duration instead (the fixed point is unbiased, where a
    step read at a third of its length weighs nine times as much as read right), and from there
    also with Tukey's bisquare weights, which leave out the steps read far off. On exact
    observations every prediction is its observation: it is `_solve`'s solution."""
    theta = _solve(samples, fixed)
    for robust in (False, True):
        theta = _reweighted(samples, fixed, theta, robust=robust)
    return theta


def _reweighted(
    samples: Sequence[Sample], fixed: Mapping[int, float], theta: tuple[float, ...], *, robust: bool
) -> tuple[float, ...]:
    """Iteratively reweighted least squares from `theta`: `_solve` with each sample's weight times
    observed / predicted at the last solution (and, `robust`, times Tukey's bisquare of its
    log(observed / predicted), `_bisquare`), until theta moves by less than `TOLERANCE` (at most
    `MAX_REWEIGHTS` solutions). A solution that predicts a step free is kept as it is."""
    for _ in range(MAX_REWEIGHTS):
        predicted = [s.predicted(theta) for s in samples]
        if min(predicted) <= 0:
            break
        logs = [math.log(s.observed / p) for s, p in zip(samples, predicted, strict=True)]
        factors = _bisquare(logs) if robust else [1.0] * len(samples)
        new = _solve([dataclasses.replace(s, weight=s.weight * s.observed / p * f)
                      for s, p, f in zip(samples, predicted, factors, strict=True)], fixed)  # fmt: skip
        moved, theta = _moved(new, theta), new
        if moved < TOLERANCE:
            break
    return theta


def _bisquare(residuals: Sequence[float]) -> list[float]:
    """Tukey's bisquare weights of `residuals`: 0 beyond `BISQUARE` robust scales (1.4826 x the
    median |residual|, the standard deviation of normal noise), all 1 when that median is 0 (at
    least half of them exact)."""
    cutoff = BISQUARE * 1.4826 * statistics.median(abs(r) for r in residuals)
    if cutoff == 0:
        return [1.0] * len(residuals)
    return [max(1 - (r / cutoff) ** 2, 0.0) ** 2 for r in residuals]


def _moved(new: Sequence[float], old: Sequence[float]) -> float:
    """The largest relative change of a term (against at least 1e-6)."""
    return max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(new, old, strict=True))


def objective(samples: Sequence[Sample], theta: Sequence[float]) -> float:
    return math.fsum((s.weight * (s.predicted(theta) - s.observed)) ** 2 for s in samples)


def initial_terms(runs: Sequence[ObservedRun]) -> Terms:
    """A start for the iteration from the probes alone: the one-request decode gap as the base,
    the TTFT slope against the prompt as the prefill term, the rest of the TTFT as delivery."""
    gaps = [b - a for run in runs if run.kind in ("prefill", "decode") for r in run.completed
            for a, b in zip(r.chunk_ts, r.chunk_ts[1:], strict=False)]  # fmt: skip
    step = statistics.median(gaps) if gaps else 0.01
    points = [(r.num_prompt_tokens, r.chunk_ts[0] - r.send_ts) for run in runs if run.kind == "prefill"
              for r in run.completed]  # fmt: skip
    slope, intercept = 0.0, step
    if len({p for p, _ in points}) >= 2:
        slope, intercept = (float(v) for v in np.polyfit([p for p, _ in points], [t for _, t in points], 1))
    return Terms(1000 * step, 1000 * max(slope, 0.0), 0.0, 0.0, 0.0, 0.0, 1000 * max(intercept - step, 0.0))


def _simulate(
    runs: Sequence[ObservedRun], config: SchedulerConfig, terms: Terms, scheduler: str, speeds: Mapping[str, float]
) -> tuple[list[Replay], list[Sample]]:
    replays = []
    samples = []
    for run in runs:
        speed = speeds.get(run.name, 1.0)
        rep = replay(run, config, terms.scaled(speed).cost(), scheduler)
        if rep is not None:
            replays.append(rep)
            samples += steady(run, linearise(rep, terms.theta, speed))
    return replays, samples


def steady(run: ObservedRun, samples: list[Sample]) -> list[Sample]:
    """`samples` with weight 0 (reported, not fitted) where a run sent its requests all at once
    (the decode sweep, the saturation run): the TTFTs, and the gaps that start before every
    request of the run has its first token. A burst reaches a server one request after another
    (parsing, tokenising), in an order the client cannot see, which decides the step each one
    joins, while the simulator admits them all at their send time; once all have started, every
    step is the steady batch the run is there to measure."""
    if run.kind != "decode" or len(run.requests) < 2:
        return samples
    started = max(r.chunk_ts[0] for r in run.completed)
    return [s if s.kind == "gap" and s.start_ts >= started else dataclasses.replace(s, weight=0.0) for s in samples]


def fit(
    runs: Sequence[ObservedRun],
    config: SchedulerConfig,
    *,
    scheduler: str = "continuous",
    start: Terms | None = None,
    method: str = "steps",
) -> FitResult:
    """Fit `Terms` to `runs` (module docstring) by `method`; ``chunks`` from `start` (default:
    `initial_terms`)."""
    if method not in METHODS:
        raise ValueError(f"unknown fit method {method!r}; known: {', '.join(METHODS)}")
    used = [run for run in runs if run.kind != "warmup" and run.completed]
    if not used:
        raise FitError("no completed request in the runs to fit (observe prefill, decode or open runs first)")
    speeds, reference = run_speeds(used)
    if method == "steps":
        steps = step_samples(used, config)
        if len(steps) >= MIN_TIMED_STEPS:
            return _fit_by_steps(used, config, scheduler, steps, reference)
    terms = start or initial_terms(used)
    closed = [run for run in used if run.kind != "open"]
    history: list[tuple[float, Terms, list[Sample]]] = []
    if closed and len(closed) < len(used):
        # the closed runs' schedules hardly depend on the terms: their fixed point is a start
        # from which the open runs' schedules (queueing decides them) are already nearly right
        terms = min(_iterate(closed, config, terms, scheduler, speeds), key=lambda h: h[0])[1]
    history = _iterate(used, config, terms, scheduler, speeds)
    best, best_terms, best_samples = min(history, key=lambda h: h[0])
    num_requests = sum(1 for s in best_samples if s.kind == "ttft")
    iterations = tuple({**t.as_dict(), "objective": j / max(num_requests, 1)} for j, t, _ in history)
    return FitResult(best_terms, best / max(num_requests, 1), num_requests, iterations,
                     residuals(used, best_samples, best_terms.theta), reference, speeds)  # fmt: skip


def step_samples(runs: Sequence[ObservedRun], config: SchedulerConfig) -> list[Sample]:
    """Every timed step of `runs` (`contbatch.observe.steps`) as a sample: its duration against
    its features, weighted as an error relative to it (`_robust_solve` makes it relative to the
    predicted duration), the decode-only steps together as much as those
    with a prefill (these are a few percent of the steps, and decide every TTFT)."""
    steps = [(run.name, step) for run in runs for step in timed_steps(run, config.max_num_batched_tokens)]
    with_prefill = sum(1 for _, step in steps if step.out.num_prefill_tokens)
    counts = (max(len(steps) - with_prefill, 1), max(with_prefill, 1))
    return [Sample(name, f"step-{step.out.step_id}", "step", step.duration_s, 0.0, (*step_features(step.out), 0.0),
                   1.0 / (step.duration_s * math.sqrt(counts[bool(step.out.num_prefill_tokens)])))
            for name, step in steps]  # fmt: skip


def _fit_by_steps(
    runs: Sequence[ObservedRun],
    config: SchedulerConfig,
    scheduler: str,
    steps: Sequence[Sample],
    reference: float | None,
) -> FitResult:
    """The step terms from the timed steps' least squares; then, each run simulated at its own
    machine speed against them (`step_totals`), the delivery from its chunks' least squares."""
    step_terms = Terms(*_robust_solve(steps, {DELIVERY: 0.0}))
    speeds = {run.name: whole_speed(step_totals(run, step_terms.cost(), config.max_num_batched_tokens))
              for run in runs}  # fmt: skip
    _, samples = _simulate(runs, config, step_terms, scheduler, speeds)
    if not samples:
        raise FitError("the simulated runs produced no chunk to compare with")
    terms = Terms(*_solve(samples, {i: v for i, v in enumerate(step_terms.theta) if i != DELIVERY}))
    num_requests = sum(1 for s in samples if s.kind == "ttft")
    j = objective(samples, terms.theta) / max(num_requests, 1)
    return FitResult(terms, j, num_requests, ({**terms.as_dict(), "objective": j},),
                     residuals(runs, samples, terms.theta), reference, speeds, "steps", len(steps))  # fmt: skip


def _iterate(
    runs: Sequence[ObservedRun], config: SchedulerConfig, terms: Terms, scheduler: str, speeds: Mapping[str, float]
) -> list[tuple[float, Terms, list[Sample]]]:
    """Simulate, linearise, solve, until theta stays put: every iterate with its objective."""
    history: list[tuple[float, Terms, list[Sample]]] = []
    for _ in range(MAX_ITERATIONS + 1):
        _, samples = _simulate(runs, config, terms, scheduler, speeds)
        if not samples:
            raise FitError("the simulated runs produced no chunk to compare with")
        history.append((objective(samples, terms.theta), terms, samples))
        if len(history) > MAX_ITERATIONS:
            break
        new = Terms(*_solve(samples))
        moved, terms = _moved(new.theta, terms.theta), new
        if moved < TOLERANCE:
            _, samples = _simulate(runs, config, terms, scheduler, speeds)
            history.append((objective(samples, terms.theta), terms, samples))
            break
    return history


def residuals(
    runs: Sequence[ObservedRun], samples: Sequence[Sample], theta: Sequence[float]
) -> tuple[RunResidual, ...]:
    """Per run: mean TTFT and TPOT observed and predicted, and the mean relative errors."""
    out = []
    for run in runs:
        mine = [s for s in samples if s.run == run.name]
        ttfts = [s for s in mine if s.kind == "ttft"]
        if not ttfts:
            continue
        gaps = [s for s in mine if s.kind == "gap"]
        by_request: dict[str, list[Sample]] = {}
        for s in gaps:
            by_request.setdefault(s.request_id, []).append(s)
        tpots = [(statistics.fmean(g.observed for g in group), statistics.fmean(g.predicted(theta) for g in group))
                 for group in by_request.values()]  # fmt: skip
        gap_err = [abs(s.predicted(theta) - s.observed) * s.weight * math.sqrt(len(by_request[s.request_id]))
                   for s in gaps]  # fmt: skip
        out.append(RunResidual(
            run.name, run.kind, len(ttfts),
            1000 * statistics.fmean(s.observed for s in ttfts),
            1000 * statistics.fmean(s.predicted(theta) for s in ttfts),
            1000 * statistics.fmean(o for o, _ in tpots) if tpots else None,
            1000 * statistics.fmean(p for _, p in tpots) if tpots else None,
            statistics.fmean(abs(s.predicted(theta) / s.observed - 1) for s in ttfts if s.observed > 0),
            statistics.fmean(gap_err) if gap_err else None,
        ))  # fmt: skip
    return tuple(out)
