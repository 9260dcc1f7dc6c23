"""Rotary position embeddings with the scaling variants transformers implements for Llama.

What it owns: inverse frequencies per `RopeSpec` (default, linear, dynamic NTK, llama3, yarn),
computed with the same float32 operations as transformers' `modeling_rope_utils` so logits
agree to rounding, and the cos/sin rows for a flat batch of positions.

Dynamic NTK: transformers recomputes the frequencies from the length of the current forward
pass once it exceeds `max_position_embeddings`. Here that length is per chunk (its `start +
num_new_tokens`), which equals transformers for one sequence generated token by token; cached keys
keep the rotation they were written with, as in transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from contbatch.engine.spec import ModelSpec, RopeSpec


def _base_inv_freq(theta: float, dim: int, device: torch.device | None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (theta**exponents)


def _llama3(rope: RopeSpec, dim: int, device: torch.device | None) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim, device)
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int, device: torch.device | None) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    original = rope.original_max_position_embeddings or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: avoid a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def inv_freq_for(
    rope: RopeSpec,
    head_dim: int,
    max_position_embeddings: int,
    *,
    seq_len: int | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float32, cos/sin scaling); `seq_len` matters for dynamic only."""
    if rope.rope_type == "default":
        return _base_inv_freq(rope.theta, head_dim, device), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, head_dim, device) / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        scale = (rope.factor * length / max_position_embeddings) - (rope.factor - 1)
        base = rope.theta * scale ** (head_dim / (head_dim - 2))
        return _base_inv_freq(base, head_dim, device), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, head_dim, device), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, device)
    raise ValueError(f"RoPE type {rope.rope_type!r} is not implemented")


class RotaryEmbedding:
    """cos/sin rows ([T, head_dim], in the model dtype) for the positions of one flat batch."""

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.inv_freq, self.scaling = inv_freq_for(
            spec.rope, spec.head_dim, spec.max_position_embeddings, device=device
        )

    def _rows(self, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(self.dtype), (emb.sin() * scaling).to(self.dtype)

    def cos_sin(
        self, positions: torch.Tensor, chunk_spans: Sequence[tuple[int, int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]. `chunk_spans`: (first token, end token, sequence length) per chunk,
        read only by dynamic NTK for chunks longer than `max_position_embeddings`."""
        cos, sin = self._rows(positions, self.inv_freq, self.scaling)
        if self.spec.rope.rope_type != "dynamic":
            return cos, sin
        max_pos = self.spec.max_position_embeddings
        for begin, end, seq_len in chunk_spans:
            if seq_len > max_pos:
                inv_freq, scaling = inv_freq_for(
                    self.spec.rope, self.spec.head_dim, max_pos, seq_len=seq_len, device=self.device
                )
                cos[begin:end], sin[begin:end] = self._rows(positions[begin:end], inv_freq, scaling)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, head_dim] (transformers' rotate-half convention)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
