"""The discrete-event simulator: traces replayed through a scheduler, steps priced by a cost model.

Imports `contbatch.core`, `contbatch.traces` and `contbatch.metrics`; never the engine, torch or
asyncio.
"""

from contbatch.sim.cost import COST_MODELS, AffineCost, CostModel, CostSpecError, UnitCost, parse_cost
from contbatch.sim.loop import SimResult, SimulationStalled, execute, make_request, simulate

__all__ = [
    "COST_MODELS",
    "AffineCost",
    "CostModel",
    "CostSpecError",
    "SimResult",
    "SimulationStalled",
    "UnitCost",
    "execute",
    "make_request",
    "parse_cost",
    "simulate",
]
