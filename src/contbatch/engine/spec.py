"""`ModelSpec`: the shape of a Llama-family model, parsed from a Hugging Face `config.json`.

What it owns: turning the config dict (transformers 4.x or 5.x spellings) into one frozen,
validated description. Supported `model_type`s are the keys of `ARCHITECTURES`: llama, mistral,
qwen2 (the same decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP). Anything else raises
`UnsupportedModel`; a missing or ill-typed field raises `CheckpointError`; both messages name the
field and the file.

Architectures: `ARCHITECTURES` maps a config.json `model_type` to an `Architecture`, everything
that differs between them: transformers' class name, which linear layers carry biases, which
layers the config's `sliding_window` applies to, and the fields that turn sliding windows off. The loader
(`expected_shapes`) and the model (`LlamaModel`) read only `ModelSpec` fields, never the
`model_type`. Adding an architecture of this decoder family is one entry here and its test
(docs/extending.md).

Spellings accepted:
- RoPE: 5.x `rope_parameters` {rope_type, rope_theta, ...}; 4.x `rope_theta` + `rope_scaling`
  {type | rope_type, ...}. Types implemented: default, linear, dynamic, llama3, yarn.
- dtype: 5.x `dtype`, 4.x `torch_dtype`.

Sliding windows (transformers' rule, `masking_utils.sliding_window_overlay`): in a layer with window
w, the query at position i attends to the keys at positions j with i - w < j <= i (the last w
positions, itself included). Mistral applies `sliding_window` (when not null) to every layer;
Qwen2 only when `use_sliding_window` is true, to the layers `layer_types` marks
"sliding_attention" (default: layers >= `max_window_layers`); Llama never. A window no shorter
than max_model_len never binds and is dropped.

Invariants of a `ModelSpec`: num_heads % num_kv_heads == 0; head_dim even; max_model_len <=
the length the RoPE configuration supports; `layer_windows` is empty (full attention everywhere)
or holds one entry per layer, each None or a window in [1, max_model_len).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contbatch.engine.errors import CheckpointError, UnsupportedModel

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DTYPE_NAMES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding parameters (transformers' `rope_parameters` after standardisation)."""

    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    theta: float = 10000.0
    factor: float = 1.0  # linear, dynamic, llama3, yarn
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None means derived from factor / mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A Llama-family decoder. Counts are `num_*`; sizes are in elements."""

    model_type: str  # a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # divides num_heads (grouped-query attention; == num_heads for MHA)
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    max_model_len: int  # longest sequence (prompt + output) this engine accepts
    rope: RopeSpec
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # q/k/v projections carry biases (qwen2; llama attention_bias)
    o_bias: bool  # o_proj carries a bias (llama attention_bias)
    mlp_bias: bool  # gate/up/down carry biases (llama mlp_bias)
    dtype: str  # the checkpoint's declared dtype (float32 | float16 | bfloat16)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # config.json and generation_config.json together
    # Per layer: the sliding window (keys at positions > i - w for the query at i) or None (full
    # attention); () when no layer has one.
    layer_windows: tuple[int | None, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class ConfigFields:
    """Typed reads from one config dict; errors name the field and the file."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {message}")

    def int(self, name: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise self.error(f"missing required field {name!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"field {name!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def float(self, name: str, default: float) -> float:
        value = self.raw.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(f"field {name!r} must be a finite number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field {name!r} must be true or false, got {value!r}")
        return value


def _token_ids(value: object, name: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointError(f"{source}: field {name!r} must be a token id or a list of them, got {value!r}")
    return tuple(items)


def _rope_dict(f: ConfigFields) -> dict[str, Any]:
    """The RoPE parameters as one dict in the 5.x layout, whichever spelling the file used."""
    params = f.raw.get("rope_parameters")
    legacy = f.raw.get("rope_scaling")
    merged: dict[str, Any] = {}
    for name, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise f.error(f"field {name!r} must be an object, got {value!r}")
        if any(isinstance(v, Mapping) for v in value.values()):
            raise UnsupportedModel(f"{f.source}: per-layer-type RoPE parameters in {name!r} are not supported")
        merged.update(value)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = rope_type
    if merged.get("rope_theta") is None:
        merged["rope_theta"] = f.float("rope_theta", 10000.0)
    if merged.get("partial_rotary_factor", f.raw.get("partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        raise UnsupportedModel(f"{f.source}: partial_rotary_factor != 1 is not supported")
    return merged


def _parse_rope(f: ConfigFields, max_position_embeddings: int) -> RopeSpec:
    d = _rope_dict(f)
    rope_type = d["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"{f.source}: RoPE type {rope_type!r} is not implemented (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    rf = ConfigFields(d, f"{f.source} (RoPE parameters)")
    needs_factor = rope_type != "default"
    factor = rf.float("factor", 1.0)
    if needs_factor and d.get("factor") is None and rope_type != "yarn":
        raise rf.error(f"RoPE type {rope_type!r} needs field 'factor'")
    original: int | None = None
    if d.get("original_max_position_embeddings") is not None:
        original = rf.int("original_max_position_embeddings")
    elif rope_type in ("llama3", "yarn"):
        original = max_position_embeddings  # transformers' standardize_rope_params does the same
    if rope_type == "yarn" and d.get("factor") is None and original is not None:
        factor = max_position_embeddings / original
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if d.get(name) is None:
                raise rf.error(f"RoPE type 'llama3' needs field {name!r}")
    return RopeSpec(
        rope_type=rope_type,
        theta=rf.float("rope_theta", 10000.0),
        factor=factor,
        original_max_position_embeddings=original,
        low_freq_factor=rf.float("low_freq_factor", 1.0),
        high_freq_factor=rf.float("high_freq_factor", 4.0),
        beta_fast=rf.float("beta_fast", 32.0) or 32.0,
        beta_slow=rf.float("beta_slow", 1.0) or 1.0,
        attention_factor=None if d.get("attention_factor") is None else rf.float("attention_factor", 1.0),
        mscale=None if d.get("mscale") is None else rf.float("mscale", 1.0),
        mscale_all_dim=None if d.get("mscale_all_dim") is None else rf.float("mscale_all_dim", 1.0),
        truncate=rf.bool("truncate", True),
    )


def _rope_max_len(rope: RopeSpec, max_position_embeddings: int) -> int:
    """The longest sequence the RoPE configuration is meant for (vLLM's rule for scaled RoPE)."""
    if rope.rope_type in ("linear", "dynamic"):
        return int(max_position_embeddings * rope.factor)
    if rope.rope_type == "yarn" and rope.original_max_position_embeddings is not None:
        return max(max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))
    return max_position_embeddings


def _layer_windows(f: ConfigFields, arch: Architecture, max_model_len: int, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (see the module docstring); () when none binds below max_model_len."""
    windows = arch.sliding_windows(f, num_layers)
    if len(windows) != num_layers:
        raise f.error(f"the sliding-window layers name {len(windows)} layers, the model has {num_layers}")
    kept = tuple(w if w is not None and w < max_model_len else None for w in windows)
    return kept if any(w is not None for w in kept) else ()


def _dtype_name(f: ConfigFields) -> str:
    value = f.raw.get("dtype", f.raw.get("torch_dtype")) or "float32"
    if isinstance(value, str) and value.startswith("torch."):
        value = value.removeprefix("torch.")
    if value not in DTYPE_NAMES:
        raise UnsupportedModel(f"{f.source}: dtype {value!r} is not supported (supported: {', '.join(DTYPE_NAMES)})")
    return str(value)


@dataclass(frozen=True, slots=True)
class Biases:
    """Which linear layers carry a bias: q/k/v projections, the output projection, the MLP's three."""

    qkv: bool = False
    o: bool = False
    mlp: bool = False


def _window_size(f: ConfigFields) -> int | None:
    window = f.raw.get("sliding_window")
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise f.error(f"field 'sliding_window' must be a positive integer or null, got {window!r}")
    return window


def _no_windows(f: ConfigFields, num_layers: int) -> tuple[int | None, ...]:
    return (None,) * num_layers


def _every_layer_windows(f: ConfigFields, num_layers: int) -> tuple[int | None, ...]:
    """Mistral: `sliding_window`, when set, in every layer."""
    return (_window_size(f),) * num_layers


@dataclass(frozen=True, slots=True)
class Architecture:
    """What differs between the `model_type`s of the engine's decoder (one `ARCHITECTURES` entry)."""

    hf_class: str  # transformers' class: config.json's `architectures` entry, e.g. "LlamaForCausalLM"
    biases: Callable[[ConfigFields], Biases] = lambda f: Biases()  # read from the config
    # Each layer's sliding window (None: full attention), as transformers reads the config;
    # (fields, num_layers) -> one entry per layer
    sliding_windows: Callable[[ConfigFields, int], tuple[int | None, ...]] = _no_windows
    # config.json fields that give full attention in transformers (random checkpoints write them)
    full_attention_config: Mapping[str, Any] = field(default_factory=dict)


def _llama_biases(f: ConfigFields) -> Biases:
    attention = f.bool("attention_bias", False)
    return Biases(qkv=attention, o=attention, mlp=f.bool("mlp_bias", False))


def _qwen2_windows(f: ConfigFields, num_layers: int) -> tuple[int | None, ...]:
    """Qwen2Config: `sliding_window` counts only with `use_sliding_window`; it applies to the layers
    `layer_types` marks "sliding_attention" (default: those at index >= `max_window_layers`)."""
    window = _window_size(f) if f.bool("use_sliding_window", False) else None
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        first = f.int("max_window_layers", 28, minimum=0)
        sliding = [window is not None and i >= first for i in range(num_layers)]
    elif isinstance(layer_types, list) and all(t in ("full_attention", "sliding_attention") for t in layer_types):
        sliding = [t == "sliding_attention" for t in layer_types]
        if any(sliding) and window is None:
            raise f.error("layer_types has 'sliding_attention' layers but no sliding window (use_sliding_window)")
    else:
        raise f.error(f"field 'layer_types' must list 'full_attention' / 'sliding_attention', got {layer_types!r}")
    return tuple(window if s else None for s in sliding)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaForCausalLM", biases=_llama_biases),
    "mistral": Architecture(
        "MistralForCausalLM", sliding_windows=_every_layer_windows, full_attention_config={"sliding_window": None}
    ),
    "qwen2": Architecture("Qwen2ForCausalLM", biases=lambda f: Biases(qkv=True), sliding_windows=_qwen2_windows),
}
"""The supported config.json `model_type`s."""


def _check_architecture(f: ConfigFields) -> str:
    model_type = f.raw.get("model_type")
    if model_type is None:
        raise f.error("missing required field 'model_type'")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModel(
            f"{f.source}: model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if f.raw.get("quantization_config") is not None:
        raise UnsupportedModel(f"{f.source}: quantized checkpoints (quantization_config) are not supported")
    act = f.raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{f.source}: hidden_act {act!r} is not supported (only 'silu')")
    return str(model_type)


def _attention_shape(f: ConfigFields) -> tuple[int, int, int, int]:
    """(hidden_size, num_heads, num_kv_heads, head_dim), checked for grouped-query attention and RoPE."""
    hidden, num_heads = f.int("hidden_size"), f.int("num_attention_heads")
    num_kv_heads = f.int("num_key_value_heads", num_heads)
    head_dim = f.int("head_dim", hidden // num_heads)
    if num_heads % num_kv_heads:
        raise f.error(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    if head_dim % 2:
        raise f.error(f"head_dim={head_dim} must be even for rotary embeddings")
    return hidden, num_heads, num_kv_heads, head_dim


def parse_config(
    raw: Mapping[str, Any],
    *,
    source: str = "config.json",
    generation_config: Mapping[str, Any] | None = None,
    max_model_len: int | None = None,
) -> ModelSpec:
    """A validated `ModelSpec` from a parsed `config.json` (and optional `generation_config.json`).

    `max_model_len` lowers the longest accepted sequence (it may not exceed what RoPE supports).
    """
    f = ConfigFields(raw, source)
    model_type = _check_architecture(f)
    arch = ARCHITECTURES[model_type]
    hidden, num_heads, num_kv_heads, head_dim = _attention_shape(f)
    num_layers = f.int("num_hidden_layers")
    max_pos = f.int("max_position_embeddings", 2048)
    rope = _parse_rope(f, max_pos)
    limit = _rope_max_len(rope, max_pos)
    if max_model_len is not None and not 1 <= max_model_len <= limit:
        raise UnsupportedModel(f"{source}: max_model_len={max_model_len} must be in [1, {limit}] for this model")
    model_len = max_model_len or limit
    layer_windows = _layer_windows(f, arch, model_len, num_layers)
    biases = arch.biases(f)
    eos = _token_ids(raw.get("eos_token_id"), "eos_token_id", source)
    if generation_config is not None:
        eos += _token_ids(generation_config.get("eos_token_id"), "eos_token_id", "generation_config.json")
    bos = _token_ids(raw.get("bos_token_id"), "bos_token_id", source)
    return ModelSpec(
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        max_model_len=model_len,
        rope=rope,
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        qkv_bias=biases.qkv,
        o_bias=biases.o,
        mlp_bias=biases.mlp,
        dtype=_dtype_name(f),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        layer_windows=layer_windows,
    )
