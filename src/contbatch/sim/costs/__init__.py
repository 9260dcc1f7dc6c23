"""Realistic cost models for the simulator, beyond `contbatch.sim.cost`'s unit and affine ones.

- `contbatch.sim.costs.roofline`: `RooflineCost` (``roofline:MODEL@DEVICE[xN][,k=v...]``), the
  max of compute and memory time from a `ModelShape` and a `DeviceSpec`, with tensor parallelism,
  mixture-of-experts routing (`ExpertRouter`), expert parallelism and swaps; `kv_blocks` sizes
  a KV cache for it;
- `contbatch.sim.costs.presets`: the model and device presets, their figures and sources;
- `contbatch.sim.costs.table`: `TableCost` (``table:PATH``), interpolated from a CSV grid;
- `contbatch.sim.costs.profile`: `ProfileCost` (``profile:PATH``), fitted by `contbatch calibrate`.

`contbatch.sim.cost.parse_cost` builds any of them from a spec string, through the registry
`contbatch.sim.cost.COST_MODELS`. This package imports the standard library, `contbatch.core`
and numpy (the MoE router's random draws), never torch or asyncio.
"""

from contbatch.sim.costs.errors import CostSpecError
from contbatch.sim.costs.presets import DEVICES, MODELS, device_preset, model_preset
from contbatch.sim.costs.roofline import DEFAULT_RESERVE_BYTES, RooflineCost, StepCost, kv_blocks
from contbatch.sim.costs.roofline_spec import ROOFLINE_PARAMS, parse_roofline
from contbatch.sim.costs.router import ROUTER_KINDS, ExpertLoadStats, ExpertLoadSummary, ExpertRouter
from contbatch.sim.costs.specs import DeviceSpec, ModelShape
from contbatch.sim.costs.table import TableCost, load_table, parse_table

__all__ = [
    "DEFAULT_RESERVE_BYTES",
    "DEVICES",
    "MODELS",
    "ROOFLINE_PARAMS",
    "ROUTER_KINDS",
    "CostSpecError",
    "DeviceSpec",
    "ExpertLoadStats",
    "ExpertLoadSummary",
    "ExpertRouter",
    "ModelShape",
    "RooflineCost",
    "StepCost",
    "TableCost",
    "device_preset",
    "kv_blocks",
    "load_table",
    "model_preset",
    "parse_roofline",
    "parse_table",
]
