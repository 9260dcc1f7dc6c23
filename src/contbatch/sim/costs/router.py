"""Mixture-of-experts routing for the roofline cost model: which experts a step's tokens reach.

`ExpertRouter.loads(num_tokens, step_id, ...)` draws, for each token, ``top_k`` distinct experts
out of ``num_experts`` and returns how many tokens each expert received. One draw stands for
every MoE layer of the step (a simplification: layers route independently in a real model).

Routing kinds (``kind``), all drawn from a numpy generator seeded by ``(seed, step_id)``, so a
step's routing depends only on its id and the router, never on earlier steps: the same sequence
of steps always costs the same (for a given numpy version), in one process or the next.

- ``uniform``: every expert equally likely (a perfectly trained load-balancing loss);
- ``zipf``: expert ``i`` (0-based) has weight ``1 / (i + 1) ** skew``; skew 0 is uniform, ~1 is
  a few hot experts;
- ``dirichlet``: each step draws expert weights from a symmetric Dirichlet with concentration
  ``skew``; large values approach uniform, values below 1 make a few experts take most tokens
  and which ones changes from step to step.

A token's ``top_k`` experts are drawn without replacement with probability proportional to the
weights, by the Gumbel-top-k trick (the ``top_k`` largest ``log weight + Gumbel noise``), which is
exactly sequential weighted sampling without replacement, vectorised over the tokens.

`ExpertLoadStats` is the running record a cost model keeps: per step, the imbalance
``max load / mean load`` (mean over all experts: ``num_tokens * top_k / num_experts``), 1.0 when
perfectly balanced, ``num_experts / top_k`` at worst.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contbatch.sim.costs.errors import CostSpecError, check_int, check_number

ROUTER_KINDS = ("uniform", "zipf", "dirichlet")
_TINY = 1e-300  # floor for Dirichlet weights that underflow: such experts are picked only when needed


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
        if num_tokens <= 0:
            return [0] * num_experts
        rng = np.random.default_rng([self.seed, step_id])
        if self.kind == "uniform" or (self.kind == "zipf" and self.skew == 0):
            keys = rng.random((num_tokens, num_experts))
        else:
            log_weights = np.log(self._weights(rng, num_experts))
            keys = -(log_weights + rng.gumbel(size=(num_tokens, num_experts)))
        chosen = np.argpartition(keys, top_k - 1, axis=1)[:, :top_k]
        counts = np.bincount(chosen.ravel(), minlength=num_experts)
        return [int(c) for c in counts]

    def _weights(self, rng: np.random.Generator, num_experts: int) -> np.ndarray:
        if self.kind == "zipf":
            return 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** self.skew
        return np.maximum(rng.dirichlet(np.full(num_experts, self.skew)), _TINY)


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
