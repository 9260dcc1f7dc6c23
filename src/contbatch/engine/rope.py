"""Rotary position embeddings with the scaling variants transformers implements for Llama.

What it owns: inverse frequencies per `RopeSpec` (default, linear, dynamic NTK, llama3, yarn),
computed with the same float32 operations as transformers' `modeling_rope_utils` so logits
agree to rounding, and the cos/sin rows for a flat batch of positions.

Dynamic NTK, as transformers' `generate` computes it for one sequence: each forward recomputes the
frequencies from `seq_len = max(position_ids) + 1` when that exceeds `max_position_embeddings`
(the base grows with it; at or below it the unscaled frequencies are used), and cached keys keep
the rotation they were written with. Its prefill is one forward over the whole prompt, each decode
one forward of one token, so the token at position p of a request whose prompt has L tokens is
rotated with `seq_len = max(p + 1, L)`: every prompt token with the prompt's length, every later
token with its own. That rule needs only the request's prompt length (`ChunkLayout.
num_prompt_tokens`), so the engine gives the same rotations whatever the chunking, after a
recompute, and for several tokens of one request in one step. A chunk without its prompt length
is refused (`ValueError`) once it reaches past `max_position_embeddings`: its rotation would
depend on how the prompt was cut. The frequencies for a length are computed as transformers does
at run time (0-d tensor arithmetic in float32, not Python floats) and kept per length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from contbatch.engine.attention import ChunkLayout
from contbatch.engine.spec import ModelSpec, RopeSpec

_MAX_CACHED_LENGTHS = 16_384  # dynamic NTK: frequencies kept for this many sequence lengths at most


def _base_inv_freq(theta: float, dim: int, device: torch.device | None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (theta**exponents)


def _dynamic_inv_freq(
    rope: RopeSpec, head_dim: int, max_position_embeddings: int, seq_len: int, device: torch.device | None
) -> torch.Tensor:
    """transformers' `_compute_dynamic_ntk_parameters` as its forward calls it: `seq_len` a 0-d int64
    tensor, so the base is computed in float32 tensor arithmetic (not Python floats)."""
    length = torch.maximum(torch.tensor(seq_len, device=device), torch.tensor(max_position_embeddings, device=device))
    base = rope.theta * ((rope.factor * length / max_position_embeddings) - (rope.factor - 1)) ** (
        head_dim / (head_dim - 2)
    )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    return 1.0 / (base**exponents)


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
        if seq_len is not None and seq_len > max_position_embeddings:
            return _dynamic_inv_freq(rope, head_dim, max_position_embeddings, seq_len, device), 1.0
        # transformers' initial frequencies (Python floats): the scale is 1 at max_position_embeddings
        scale = (rope.factor * max_position_embeddings / max_position_embeddings) - (rope.factor - 1)
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
        self._dynamic: dict[int, torch.Tensor] = {}  # seq_len -> inverse frequencies (dynamic NTK)

    def _rows(self, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(self.dtype), (emb.sin() * scaling).to(self.dtype)

    def cos_sin(
        self, positions: torch.Tensor, layouts: Sequence[ChunkLayout] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]. `layouts`: the chunks tiling the flat batch, read only by
        dynamic NTK (see the module docstring)."""
        cos, sin = self._rows(positions, self.inv_freq[None, :], self.scaling)
        if self.spec.rope.rope_type != "dynamic":
            return cos, sin
        own: list[int] = []  # flat tokens rotated with their own length (position + 1)
        for begin, end, length in self._scaled_spans(layouts):
            if length is not None:  # prompt tokens: the prompt's length
                inv_freq = self._inv_freq_at(length)[None, :]
                cos[begin:end], sin[begin:end] = self._rows(positions[begin:end], inv_freq, self.scaling)
            else:
                own.extend(range(begin, end))
        if own:
            index = torch.tensor(own, dtype=torch.long, device=positions.device)
            at = positions.index_select(0, index)
            inv_freq = torch.stack([self._inv_freq_at(p + 1) for p in at.tolist()])
            cos[index], sin[index] = self._rows(at, inv_freq, self.scaling)
        return cos, sin

    def _scaled_spans(self, layouts: Sequence[ChunkLayout]) -> list[tuple[int, int, int | None]]:
        """(first flat token, end, seq_len) of the tokens whose seq_len exceeds max_position_embeddings:
        seq_len the prompt's length, or None when it is each token's position + 1."""
        max_pos = self.spec.max_position_embeddings
        spans: list[tuple[int, int, int | None]] = []
        for c in layouts:
            end = c.start + c.num_tokens
            prompt = c.num_prompt_tokens or None  # 0: not given
            if prompt is None:
                if end > max_pos:
                    raise ValueError(
                        f"dynamic NTK RoPE past max_position_embeddings={max_pos} (a chunk ends at {end}) needs "
                        "the request's prompt length (ChunkLayout.num_prompt_tokens)"
                    )
                continue
            split = min(max(prompt, c.start), end)  # positions [start, split) are prompt tokens
            if split > c.start and prompt > max_pos:
                spans.append((c.token_begin, c.token_begin + split - c.start, prompt))
            first_own = max(split, max_pos)  # from here on, position + 1 > max_position_embeddings
            if first_own < end:
                spans.append((c.token_begin + first_own - c.start, c.token_begin + c.num_tokens, None))
        return spans

    def _inv_freq_at(self, seq_len: int) -> torch.Tensor:
        cached = self._dynamic.get(seq_len)
        if cached is None:
            if len(self._dynamic) >= _MAX_CACHED_LENGTHS:
                self._dynamic.clear()
            spec = self.spec
            cached = _dynamic_inv_freq(spec.rope, spec.head_dim, spec.max_position_embeddings, seq_len, self.device)
            self._dynamic[seq_len] = cached
        return cached


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, head_dim] (transformers' rotate-half convention).

    The same bits as transformers' `x * cos + rotate_half(x) * sin`, in half the memory passes:
    cos and sin repeat their first half (`RotaryEmbedding` concatenates the frequencies with
    themselves), so with halves x1, x2 and c, s the output's halves are x1 * c - x2 * s and
    x2 * c + x1 * s, each product rounded before the sum as there (a + (-b) is a - b exactly).
    Written into one new tensor, without the concatenated, negated copy of x.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    out = torch.empty_like(x)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=first)
    first.sub_(x2 * s)
    torch.mul(x2, c, out=second)
    second.add_(x1 * s)
    return out
