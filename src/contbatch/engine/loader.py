"""Load a local Hugging Face checkpoint directory: `config.json` and `*.safetensors` weights.

What it owns: finding and reading the files of one directory (never the network, never a hub
lookup), checking every tensor the model needs is present exactly once with the shape the
config implies, and returning them under transformers' names.

Weights: `model.safetensors.index.json` (sharded; every listed shard must exist and hold what
the index says), else `model.safetensors`, else every `*.safetensors` in the directory.
Ignored tensors: rotary `inv_freq` buffers, and `lm_head.weight` when embeddings are tied. Any
other unexpected tensor is an error (it means another architecture).

Errors: `CheckpointError` (missing or malformed files, missing, duplicate or mis-shaped tensors)
and `UnsupportedModel` (see `contbatch.engine.spec`), each naming the file and the field/tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from contbatch.engine.errors import CheckpointError
from contbatch.engine.spec import ModelSpec, RopeSpec, parse_config

__all__ = [
    "CheckpointError",
    "ModelSpec",
    "RopeSpec",
    "expected_shapes",
    "load_checkpoint",
    "load_spec",
    "load_weights",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _checkpoint_dir(path: str | Path) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (a local checkpoint directory is required)")
    return directory


def load_spec(path: str | Path, *, max_model_len: int | None = None) -> ModelSpec:
    """The `ModelSpec` of the checkpoint in directory `path` (config.json, optional generation_config.json)."""
    directory = _checkpoint_dir(path)
    config_path = directory / "config.json"
    raw = _read_json(config_path)
    gen_path = directory / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else None
    return parse_config(raw, source=str(config_path), generation_config=generation, max_model_len=max_model_len)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for every weight the model reads (transformers' names)."""
    h, inter = spec.hidden_size, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = {"q": spec.q_size, "k": spec.kv_size, "v": spec.kv_size}
        for name, size in attn.items():
            shapes[f"{p}self_attn.{name}_proj.weight"] = (size, h)
            if spec.qkv_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (size,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, spec.q_size)
        if spec.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (h,)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, inter)
        if spec.mlp_bias:
            for name, size in (("gate", inter), ("up", inter), ("down", h)):
                shapes[f"{p}mlp.{name}_proj.bias"] = (size,)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    return shapes


def _weight_files(directory: Path) -> dict[Path, set[str] | None]:
    """Shard path -> tensor names the index assigns to it (None: whatever the file holds)."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
        shards: dict[Path, set[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(directory / str(shard), set()).add(name)
        for shard_path in shards:
            if not shard_path.is_file():
                raise CheckpointError(f"{index_path}: lists shard {shard_path.name!r}, which does not exist")
        return dict(shards)
    if (directory / SINGLE_FILE).is_file():
        return {directory / SINGLE_FILE: None}
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" (found {', '.join(others)}: only safetensors is supported)" if others else ""
        raise CheckpointError(f"{directory}: no *.safetensors weights{hint}")
    return dict.fromkeys(found)


def _is_ignored(name: str, spec: ModelSpec) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (spec.tie_word_embeddings and name == "lm_head.weight")


def _read_shard(
    path: Path,
    listed: set[str] | None,
    spec: ModelSpec,
    expected: Mapping[str, tuple[int, ...]],
    out: dict[str, torch.Tensor],
) -> None:
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    with handle as f:
        names = set(f.keys())
        if listed is not None and (missing := sorted(listed - names)):
            raise CheckpointError(f"{path}: the index lists tensors this shard lacks: {missing[:5]}")
        for name in sorted(names if listed is None else listed):
            if _is_ignored(name, spec):
                continue
            if name not in expected:
                raise CheckpointError(f"{path}: unexpected tensor {name!r} (not a {spec.model_type} weight)")
            if name in out:
                raise CheckpointError(f"{path}: tensor {name!r} appears in more than one file")
            shape = tuple(f.get_slice(name).get_shape())
            if shape != expected[name]:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {list(shape)}, config implies {list(expected[name])}"
                )
            out[name] = f.get_tensor(name)


def load_weights(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every weight the model needs, on CPU in the checkpoint's dtype, checked against `spec`."""
    directory = _checkpoint_dir(path)
    expected = expected_shapes(spec)
    weights: dict[str, torch.Tensor] = {}
    for shard, listed in _weight_files(directory).items():
        _read_shard(shard, listed, spec, expected, weights)
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{directory}: missing tensors {missing[:5]}{more}")
    return weights


def load_checkpoint(path: str | Path, *, max_model_len: int | None = None) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(spec, weights) of a local checkpoint directory; see `load_spec` and `load_weights`."""
    spec = load_spec(path, max_model_len=max_model_len)
    return spec, load_weights(path, spec)
