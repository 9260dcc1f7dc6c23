"""Mixture-of-experts routing for the roofline cost model: which experts a step's tokens reach.

`ExpertRouter.loads(num_tokens, step_id, ...)` draws, for each token, ``top_k`` distinct experts
out of ``num_experts`` and returns how many tokens each expert received. One draw stands for
every MoE layer of the step (a simplification: layers route independently in a real model).

Routing kinds (``kind``), all drawn from a `random.Random` seeded by ``(seed, step_id)``, so a
step's routing depends only on its id and the router, never on earlier steps or wall-clock
state: the same sequence of steps always costs the same, in one process or the next.

- ``uniform``: every expert equally likely (a perfectly trained load-balancing loss);
- ``zipf``: expert ``i`` (0-based) has weight ``1 / (i + 1) ** skew``; skew 0 is uniform, ~1 is
  a few hot experts;
- ``dirichlet``: each step draws expert weights from a symmetric Dirichlet with concentration
  ``skew``; large values approach uniform, values below 1 make a few experts take most tokens
  and which ones changes from step to step.

A token's ``top_k`` experts are drawn without replacement with probability proportional to the
weights (redrawing a repeat, then, past a few repeats, drawing from the remaining experts
directly: both give exactly the renormalised distribution).

`ExpertLoadStats` is the running record a cost model keeps: per step, the imbalance
``max load / mean load`` (mean over all experts: ``num_tokens * top_k / num_experts``), 1.0 when
perfectly balanced, ``num_experts / top_k`` at worst.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass, field

from contbatch.sim.costs.errors import CostSpecError, check_int, check_number

ROUTER_KINDS = ("uniform", "zipf", "dirichlet")
_MAX_REDRAWS = 8
_SEED_STRIDE = 1 << 40  # keeps (seed, step_id) pairs apart for any realistic step count


@dataclass(frozen=True, slots=True)
class ExpertRouter:
    kind: str = "uniform"  # one of ROUTER_KINDS
    skew: float = 1.0  # zipf exponent (>= 0) or Dirichlet concentration (> 0)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise CostSpecError(f"expert router: kind must be one of {', '.join(ROUTER_KINDS)}, got {self.kind!r}")
        check_number("expert router", "skew", self.skew, exclusive=self.kind == "dirichlet")
        check_int("expert router", "seed", self.seed, minimum=0)

    def loads(self, num_tokens: int, step_id: int, num_experts: int, top_k: int) -> list[int]:
        """Tokens routed to each expert; ``sum == num_tokens * top_k``, each load <= num_tokens."""
        rng = random.Random(self.seed * _SEED_STRIDE + step_id)
        loads = [0] * num_experts
        if self.kind == "uniform" or (self.kind == "zipf" and self.skew == 0):
            experts = range(num_experts)
            for _ in range(num_tokens):
                for e in rng.sample(experts, top_k):
                    loads[e] += 1
            return loads
        weights = self._weights(rng, num_experts)
        cumulative = list(itertools.accumulate(weights))
        for _ in range(num_tokens):
            for e in _draw_distinct(rng, weights, cumulative, top_k):
                loads[e] += 1
        return loads

    def _weights(self, rng: random.Random, num_experts: int) -> list[float]:
        if self.kind == "zipf":
            return [1.0 / (i + 1) ** self.skew for i in range(num_experts)]
        return [rng.gammavariate(self.skew, 1.0) for _ in range(num_experts)]


def _draw_distinct(rng: random.Random, weights: list[float], cumulative: list[float], k: int) -> list[int]:
    chosen: list[int] = []
    total = cumulative[-1]
    redraws = 0
    while len(chosen) < k:
        if total > 0 and redraws < _MAX_REDRAWS:
            e = min(bisect.bisect_right(cumulative, rng.random() * total), len(weights) - 1)
            if e in chosen:
                redraws += 1
                continue
        else:
            e = _draw_remaining(rng, weights, chosen)
        chosen.append(e)
    return chosen


def _draw_remaining(rng: random.Random, weights: list[float], chosen: list[int]) -> int:
    """One expert not in ``chosen``, by weight (uniformly if the remaining weight is zero)."""
    remaining = [e for e in range(len(weights)) if e not in chosen]
    mass = [weights[e] for e in remaining]
    if sum(mass) <= 0:
        return remaining[int(rng.random() * len(remaining))]
    return rng.choices(remaining, weights=mass)[0]


@dataclass(frozen=True, slots=True)
class ExpertLoadSummary:
    num_steps: int  # steps with at least one routed token
    mean_imbalance: float  # mean over those steps of max load / mean load (1.0 when none)
    max_imbalance: float


@dataclass(slots=True)
class ExpertLoadStats:
    """Per-step expert-load imbalance, appended by the cost model that owns it."""

    steps: list[tuple[int, float]] = field(default_factory=list)  # (step id, max load / mean load)

    def record(self, step_id: int, imbalance: float) -> None:
        self.steps.append((step_id, imbalance))

    def summary(self) -> ExpertLoadSummary:
        values = [v for _, v in self.steps]
        if not values:
            return ExpertLoadSummary(0, 1.0, 1.0)
        return ExpertLoadSummary(len(values), sum(values) / len(values), max(values))

    def clear(self) -> None:
        self.steps.clear()


def imbalance(loads: list[int], top_k: int, num_tokens: int) -> float:
    """max load / mean load; 1.0 without tokens."""
    if num_tokens <= 0:
        return 1.0
    mean = num_tokens * top_k / len(loads)
    return max(loads) / mean
