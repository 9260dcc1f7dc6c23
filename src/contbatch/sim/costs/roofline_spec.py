"""The ``roofline:MODEL@DEVICE[xN][,k=v...]`` spec: presets by name, overrides by parameter.

``MODEL`` and ``DEVICE`` are preset names (`contbatch.sim.costs.presets`, case-insensitive, a few
aliases such as ``a100-80gb`` and ``h100-sxm``); ``xN`` is the tensor-parallel device count.
Parameters: ``eff`` (compute and memory efficiency together), ``compute_eff``, ``mem_eff``,
``link_eff`` (each in (0, 1]; a specific one wins over ``eff``), ``overhead_ms``, ``block_size``,
``bytes`` and ``kv_bytes`` (bytes per weight / KV value), and for MoE models only ``ep``,
``router``, ``skew``, ``seed``. Unknown names and parameters are `CostSpecError`s listing the
known ones.
"""

from __future__ import annotations

import dataclasses
import re

from contbatch.sim.costs.errors import CostSpecError, float_param, int_param, split_params
from contbatch.sim.costs.presets import DEVICES, MODELS, device_preset, model_preset
from contbatch.sim.costs.roofline import RooflineCost
from contbatch.sim.costs.router import ROUTER_KINDS, ExpertRouter
from contbatch.sim.costs.specs import DeviceSpec, ModelShape

ROOFLINE_PARAMS = (
    "eff",
    "compute_eff",
    "mem_eff",
    "link_eff",
    "overhead_ms",
    "block_size",
    "bytes",
    "kv_bytes",
    "ep",
    "router",
    "skew",
    "seed",
)
_MOE_PARAMS = ("ep", "router", "skew", "seed")
_TARGET = re.compile(r"(?P<model>[^@,]+)@(?P<device>[a-z0-9.\-]+?)(?:x(?P<count>\d+))?", re.IGNORECASE)
_WHAT = "roofline cost"


def roofline_usage() -> str:
    return (
        f"roofline:MODEL@DEVICE[xN][,k=v...] with MODEL in {', '.join(MODELS)}; DEVICE in {', '.join(DEVICES)}; "
        f"k in {', '.join(ROOFLINE_PARAMS)}"
    )


def parse_roofline(args: str) -> RooflineCost:
    """The `RooflineCost` of ``MODEL@DEVICE[xN][,k=v...]`` (the text after ``roofline:``)."""
    target, _, rest = args.partition(",")
    match = _TARGET.fullmatch(target.strip())
    if match is None:
        raise CostSpecError(f"{_WHAT}: bad target {target!r}; expected {roofline_usage()}")
    model = model_preset(match["model"])
    if model is None:
        raise CostSpecError(f"{_WHAT}: unknown model {match['model']!r}; known: {', '.join(MODELS)}")
    device = device_preset(match["device"])
    if device is None:
        raise CostSpecError(f"{_WHAT}: unknown device {match['device']!r}; known: {', '.join(DEVICES)}")
    num_devices = int_param(match["count"] or "1", "device count", _WHAT)
    params = split_params(rest, known=ROOFLINE_PARAMS, what=_WHAT)
    if not model.is_moe and (used := [k for k in _MOE_PARAMS if k in params]):
        raise CostSpecError(f"{_WHAT}: {', '.join(used)} apply only to mixture-of-experts models, not {model.name}")
    return RooflineCost(
        model=_model_overrides(model, params),
        device=_device_overrides(device, params),
        num_devices=num_devices,
        expert_parallel=int_param(params.get("ep", "1"), "ep", _WHAT),
        overhead_ms=float_param(params.get("overhead_ms", "0.6"), "overhead_ms", _WHAT),
        block_size=int_param(params.get("block_size", "16"), "block_size", _WHAT),
        router=_router(params),
    )


def _fraction(params: dict[str, str], key: str) -> float | None:
    if key not in params:
        return None
    value = float_param(params[key], key, _WHAT, exclusive=True)
    if value > 1:
        raise CostSpecError(f"{_WHAT}: parameter {key} must be in (0, 1], got {params[key]!r}")
    return value


def _device_overrides(device: DeviceSpec, params: dict[str, str]) -> DeviceSpec:
    both = _fraction(params, "eff")
    compute, memory, link = (_fraction(params, key) for key in ("compute_eff", "mem_eff", "link_eff"))
    return dataclasses.replace(
        device,
        compute_efficiency=_first(compute, both, device.compute_efficiency),
        memory_efficiency=_first(memory, both, device.memory_efficiency),
        link_efficiency=_first(link, device.link_efficiency),
    )


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


def _model_overrides(model: ModelShape, params: dict[str, str]) -> ModelShape:
    def size(key: str, default: float) -> float:
        return float_param(params[key], key, _WHAT, exclusive=True) if key in params else default

    return dataclasses.replace(
        model,
        bytes_per_value=size("bytes", model.bytes_per_value),
        kv_bytes_per_value=size("kv_bytes", model.kv_bytes_per_value),
    )


def _router(params: dict[str, str]) -> ExpertRouter:
    kind = params.get("router", "uniform")
    if kind not in ROUTER_KINDS:
        raise CostSpecError(f"{_WHAT}: router must be one of {', '.join(ROUTER_KINDS)}, got {kind!r}")
    skew = float_param(params.get("skew", "1"), "skew", _WHAT, exclusive=kind == "dirichlet")
    seed = int_param(params.get("seed", "0"), "seed", _WHAT, minimum=0)
    return ExpertRouter(kind=kind, skew=skew, seed=seed)
