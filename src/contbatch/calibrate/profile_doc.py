"""The profile file: `ProfileCost`'s ``cost`` object plus where and how it was measured.

Keys besides ``format``, ``version`` and ``cost`` (`contbatch.sim.costs.profile` states those):
``created`` (UTC, ISO 8601), ``machine`` (host, platform, processor, CPU count, Python),
``model`` (path, type, shape, parameters), ``engine`` (device, dtype, torch threads, torch
version, block size, KV cache bytes), ``grid`` (axes, warm-up, repeats, clock), ``fits`` (both models'
coefficients, held-out errors and score), ``chosen``, ``speed_probe`` (`contbatch.calibrate.probe`:
the probe's times per point ``"prefill,decode,context"``, ``timed`` before, between and after the
calibration engine runs, their geometric mean ``ms``, the reference `contbatch validate` measures
the machine's speed against, and ``run_speeds``, each run's speed against it),
and ``samples`` (every measured step as ``[prefill, decode, context, requests, ms]``: the grid,
the held-out points, the engine steps, these brought to the reference speed). The simulator reads
only ``cost``; the rest is for reports and for `contbatch validate`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from contbatch.calibrate.fit import StepSample
from contbatch.calibrate.probe import mean_probe
from contbatch.sim.cost import AffineCost
from contbatch.sim.costs.profile import AFFINE_FIELDS, PROFILE_FORMAT, PROFILE_VERSION, ProfileCost
from contbatch.sim.costs.table import TableCost

if TYPE_CHECKING:
    from contbatch.calibrate.calibration import CalibrationConfig, Candidate
    from contbatch.engine.llm_engine import LLMEngine


def machine_info() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    runner = engine.runner
    return {
        "device": str(runner.device),
        "dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "block_size": runner.kv_cache.block_size,
        "kv_cache_bytes": engine.config.kv_cache_memory,
        "num_kv_blocks": runner.kv_cache.num_blocks,
    }


def model_info(engine: LLMEngine) -> dict[str, Any]:
    spec = engine.runner.spec
    return {
        "path": str(engine.model_path),
        "name": Path(engine.model_path).name,
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "num_parameters": _num_parameters(engine),
    }


def _num_parameters(engine: LLMEngine) -> int:
    """Elements of the model's weight tensors (a tied output head counted once)."""
    model = engine.runner.model
    tensors = [model.embed, model.final_norm]
    if not engine.runner.spec.tie_word_embeddings:
        tensors.append(model.lm_head_t)
    for layer in model.layers:
        tensors += [v for f in dataclasses.fields(layer) if isinstance(v := getattr(layer, f.name), torch.Tensor)]
    return sum(t.numel() for t in tensors)


def cost_object(profile: ProfileCost, fits: Mapping[str, AffineCost | TableCost]) -> dict[str, Any]:
    """The ``cost`` object: both fits, the chosen one named, the loop correction of the chosen one."""
    affine, table = fits["affine"], fits["table"]
    assert isinstance(affine, AffineCost) and isinstance(table, TableCost)
    return {
        "model": profile.model,
        "loop_scale": profile.loop_scale,
        "prefill_loop_scale": profile.prefill_loop_scale,
        "decode_loop_scales": [list(pair) for pair in profile.decode_loop_scales],
        "loop_base_ms": profile.loop_base_ms,
        "loop_request_ms": profile.loop_request_ms,
        "swap_ms_per_block": affine.swap_ms_per_block,
        "affine": {name: getattr(affine, name) for name in AFFINE_FIELDS},
        "table": {
            "prefill_axis": list(table.prefill_axis),
            "decode_axis": list(table.decode_axis),
            "context_axis": list(table.context_axis),
            "step_ms": list(table.step_ms),
        },
    }


def _rows(samples: Sequence[StepSample]) -> list[list[float | int]]:
    return [[s.num_prefill_tokens, s.num_decode_tokens, s.num_context_tokens, s.num_requests, round(s.ms, 4)]
            for s in samples]  # fmt: skip


def profile_document(
    *,
    config: CalibrationConfig,
    engine: LLMEngine,
    profile: ProfileCost,
    fits: Mapping[str, AffineCost | TableCost],
    candidates: Mapping[str, Candidate],
    chosen: str,
    samples: Mapping[str, Sequence[StepSample]],
    loop_execute_ms: Sequence[float],
    speed_probe: tuple[Sequence[Mapping[str, float]], Sequence[float]],
) -> dict[str, Any]:
    """The profile file's contents; `speed_probe` = (the probes in the order timed, each engine run's speed)."""
    grid = config.grid
    probes, run_speeds = speed_probe
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": model_info(engine),
        "engine": engine_info(engine),
        "grid": {
            "prefill": list(grid.prefill),
            "decode": list(grid.decode),
            "context_per_decode": list(grid.context),
            "warmup": grid.warmup,
            "repeats": grid.repeats,
            "clock": grid.clock,
            "num_heldout": config.num_heldout,
            "engine_run_requests": config.loop_requests,
            "engine_runs": config.loop_runs,
            "engine_run_load": config.loop_load,
            "seed": config.seed,
        },
        "cost": cost_object(profile, fits),
        "chosen": chosen,
        "fits": {
            name: {
                "score": c.score,
                "heldout_grid": c.grid_heldout.as_dict(),
                "heldout_engine_steps": c.loop_heldout.as_dict(),
                "loop_scale": c.profile.loop_scale,
                "prefill_loop_scale": c.profile.prefill_loop_scale,
            }
            for name, c in candidates.items()
        },
        "speed_probe": {
            "ms": mean_probe(*probes),
            "timed": [dict(probe) for probe in probes],
            "run_speeds": list(run_speeds),
        },
        "samples": {name: _rows(rows) for name, rows in samples.items()},
        "engine_steps_execute_ms": [round(v, 4) for v in loop_execute_ms],
    }


def write_profile(document: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
