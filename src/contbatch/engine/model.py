"""The engine's own Llama-family decoder for inference over a flat batch: one class for every
`model_type` of `contbatch.engine.spec.ARCHITECTURES` (their differences are `ModelSpec` fields).

What it owns: the weights, each matrix laid out once for the device's matmul
(`contbatch.engine.linear.pack_weight`: in the native kernels' column panels or oneDNN-packed
on CPU, pre-transposed `[in, out]` elsewhere; the `*_t` fields and `lm_head_t` hold that
operand), with q/k/v fused into one matrix and gate/up into another, and `forward`, which runs
one step: flat token ids and positions in, logits out only for the rows that are sampled.

Numerics follow transformers: RMSNorm in float32 then cast back, cos/sin computed in float32 and
cast to the model dtype, softmax inside scaled-dot-product attention. On the CPU in float32 the
native kernels (`contbatch.engine.native`) fuse each residual add with the RMSNorm after it into
one pass, and apply the MLP's silu(gate) * up inside the gate and up projections' product
(`contbatch.engine.linear.gated_linear`): the same formulas, to float32 rounding. The residual
stream's last add is made for the sampled rows only. float32 on CPU;
float16/bfloat16 only on CUDA. A layer with a sliding window (`ModelSpec.layer_windows`) attends
through the step's windowed metadata (`contbatch.engine.attention.windowed`), built once per step
and window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from contbatch.engine.argmax_head import ArgmaxHead
from contbatch.engine.attention import AttentionMetadata, attention_kernels, paged_attention, windowed
from contbatch.engine.device import resolve_device
from contbatch.engine.host_memory import retain_freed_memory
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.linear import gated_linear, in_panels, linear, pack_weight
from contbatch.engine.native import add_rms_norm, panel_product, rotate_in_place
from contbatch.engine.rope import RotaryEmbedding, apply_rotary
from contbatch.engine.spec import ModelSpec


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """float32 on CPU (half precision is several times slower there); the requested dtype on CUDA."""
    dtype = getattr(torch, name) if isinstance(name, str) else name
    if dtype is None:
        return torch.float32
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {name!r} is not supported (float32, float16, bfloat16)")
    if device.type == "cpu" and dtype != torch.float32:
        raise ValueError(f"dtype {name!r} is CUDA-only here; use float32 on CPU")
    return dtype


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's weights; each `*_t` is a `pack_weight` operand of the named shape [in -> out]."""

    input_norm: torch.Tensor  # [H]
    qkv_t: torch.Tensor  # H -> q_size + 2 * kv_size
    qkv_bias: torch.Tensor | None
    o_t: torch.Tensor  # q_size -> H
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up_t: torch.Tensor  # H -> 2 * I
    gate_up_bias: torch.Tensor | None
    down_t: torch.Tensor  # I -> H
    down_bias: torch.Tensor | None


def _fuse_t(
    weights: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The named [out, in] matrices concatenated along out, as `linear`'s operand."""
    fused = torch.cat([weights[n].to(device=device, dtype=dtype) for n in names], dim=0)
    return pack_weight(fused, device, dtype)


def _fuse_bias(
    weights: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    if names[0] not in weights:
        return None
    return torch.cat([weights[n].to(device=device, dtype=dtype) for n in names], dim=0)


def _layer(weights: Mapping[str, torch.Tensor], i: int, dtype: torch.dtype, device: torch.device) -> LayerWeights:
    p = f"model.layers.{i}."
    qkv = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
    gate_up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]

    def one(name: str) -> torch.Tensor:
        return weights[name].to(device=device, dtype=dtype)

    def bias(name: str) -> torch.Tensor | None:
        return one(name) if name in weights else None

    return LayerWeights(
        input_norm=one(f"{p}input_layernorm.weight"),
        qkv_t=_fuse_t(weights, qkv, dtype, device),
        qkv_bias=_fuse_bias(weights, [n.replace(".weight", ".bias") for n in qkv], dtype, device),
        o_t=_fuse_t(weights, [f"{p}self_attn.o_proj.weight"], dtype, device),
        o_bias=bias(f"{p}self_attn.o_proj.bias"),
        post_norm=one(f"{p}post_attention_layernorm.weight"),
        gate_up_t=_fuse_t(weights, gate_up, dtype, device),
        gate_up_bias=_fuse_bias(weights, [n.replace(".weight", ".bias") for n in gate_up], dtype, device),
        down_t=_fuse_t(weights, [f"{p}mlp.down_proj.weight"], dtype, device),
        down_bias=bias(f"{p}mlp.down_proj.bias"),
    )


class LlamaModel:
    """Inference-only decoder; `forward` is the only entry point (no autograd, no module hooks)."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        """`weights`: transformers names (`model.layers.0.self_attn.q_proj.weight`, ...), as the loader checks them."""
        self.spec = spec
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cpu":
            retain_freed_memory()  # a step's large temporaries reuse memory instead of faulting pages in
        with torch.no_grad():
            self.embed = weights["model.embed_tokens.weight"].to(device=self.device, dtype=self.dtype)
            self.layers = [_layer(weights, i, self.dtype, self.device) for i in range(spec.num_layers)]
            self.final_norm = weights["model.norm.weight"].to(device=self.device, dtype=self.dtype)
            head = self.embed if spec.tie_word_embeddings else weights["lm_head.weight"]
            head = head.to(device=self.device, dtype=self.dtype)
            # A separate operand even when tied: the embedding stays a plain matrix for its row lookup.
            self.lm_head_t = pack_weight(head, self.device, self.dtype)
            # A one-row step (a lone decode) multiplies the head, the largest matrix, as a
            # matrix-vector product, which MKL streams from the plain [in, out] matrix at memory
            # speed and oneDNN's packed kernel about 30 % slower: a oneDNN head keeps that copy too.
            self.lm_head_row_t = head.t().contiguous() if self.lm_head_t.is_mkldnn else None
            # A greedy step that reads no logits takes its argmax from the head in bfloat16, exactly
            # (contbatch.engine.argmax_head); None where that does not run.
            self.argmax_head = ArgmaxHead.build(head, self.lm_head_t)
        self.rotary = RotaryEmbedding(spec, dtype=self.dtype, device=self.device)
        self.scale = spec.head_dim**-0.5

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm: normalised in float32, cast back, then scaled by `weight`
        (`F.rms_norm` without a weight gives the same bits as its pow / mean / rsqrt / mul; with a
        float32 weight on float32 x on CPU, its fused scaling is the same rounded product, in one pass)."""
        eps = self.spec.rms_norm_eps
        if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
            return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
        return weight * h.to(x.dtype)

    def _attention(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Self-attention of `x` (the normalised hidden states); q and k heads are rotated in one
        call: in place in the projection's output by the native kernel where it runs."""
        cos, sin = rope
        s = self.spec
        qkv = linear(x, layer.qkv_t, layer.qkv_bias)
        qk, v = torch.split(qkv, [s.q_size + s.kv_size, s.kv_size], dim=-1)
        qk = qk.view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
        if not rotate_in_place(qk, cos, sin):
            qk = apply_rotary(qk, cos, sin)
        q, k = torch.split(qk, [s.num_heads, s.num_kv_heads], dim=1)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        o = paged_attention(q, k, v, cache, meta, scale=self.scale)
        return linear(o.view(-1, s.q_size), layer.o_t, layer.o_bias)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """`h += delta` (the residual add, when given), then h normalised by `weight` as a new
        tensor: in one pass by the native kernel where it runs (`contbatch.engine.native`)."""
        fused = add_rms_norm(h, delta, weight, self.spec.rms_norm_eps)
        if fused is not None:
            return fused
        if delta is not None:
            h += delta
        return self._rms_norm(h, weight)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """down(silu(gate) * up), the activation by `gated_linear` (one native pass where it runs)."""
        return linear(gated_linear(x, layer.gate_up_t, layer.gate_up_bias), layer.down_t, layer.down_bias)

    @property
    def argmax_only_head(self) -> bool:
        """Whether `forward` can give each row's argmax alone (`argmax_only`), from the LM head in
        bfloat16 (`contbatch.engine.argmax_head`)."""
        return self.argmax_head is not None

    @property
    def greedy_in_head(self) -> bool:
        """Whether `forward` can also give each row's argmax (`greedy_out`): the LM head is in the
        native kernels' column panels, whose product finds it while the logits are in cache."""
        return in_panels(self.lm_head_t)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        *,
        greedy_out: torch.Tensor | None = None,
        argmax_only: bool = False,
    ) -> torch.Tensor:
        """Logits [len(meta.sample_indices), vocab] (float32) for flat `input_ids`, `positions` [T].

        Writes every token's K/V into `kv_cache` at `meta.slot_mapping`. With `greedy_out` (an
        int64 [rows] CPU tensor; only where `greedy_in_head`), also each row's `torch.argmax`.
        With `argmax_only` (and `greedy_out`; only where `argmax_only_head`), the argmax alone: the
        same tokens, the logits returned empty ([rows, 0]).
        """
        if greedy_out is not None and not self.greedy_in_head:
            raise ValueError("greedy_out needs the LM head in column panels (greedy_in_head)")
        if argmax_only and (greedy_out is None or self.argmax_head is None):
            raise ValueError("argmax_only needs greedy_out and the bfloat16 head (argmax_only_head)")
        if input_ids.shape != positions.shape or input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} / positions / metadata disagree on the token count")
        h = self.embed.index_select(0, input_ids)  # a new tensor: the residual stream is updated in place
        rope = self.rotary.cos_sin(positions, meta.layouts)
        windows = self.spec.layer_windows or (None,) * len(self.layers)
        metas = {w: windowed(meta, w) for w in set(windows)}
        delta: torch.Tensor | None = None  # what the residual stream adds next
        with attention_kernels(self.device):
            for i, layer in enumerate(self.layers):
                m = metas[windows[i]]
                delta = self._attention(self._add_norm(h, delta, layer.input_norm), layer, rope, m, kv_cache.layer(i))
                delta = self._mlp(self._add_norm(h, delta, layer.post_norm), layer)
        rows = meta.sample_indices  # the last residual add, for the sampled rows only
        last = None if delta is None else delta.index_select(0, rows)
        h = self._add_norm(h.index_select(0, rows), last, self.final_norm)
        if argmax_only and greedy_out is not None:  # (both, as checked above)
            return self._argmax(h, greedy_out)
        return self._logits(h, greedy_out).float()

    def _argmax(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Each row's argmax into `out` from the bfloat16 head, the rows it leaves to float32 by the
        panel product; empty logits [R, 0]."""
        assert self.argmax_head is not None
        left = self.argmax_head.argmax(h, out)
        if left.numel():
            picks = torch.empty(left.numel(), dtype=torch.long)
            panel_product(h.index_select(0, left), self.lm_head_t, argmax=picks)
            out[left] = picks
        return h.new_empty((h.shape[0], 0))

    def _logits(self, h: torch.Tensor, greedy_out: torch.Tensor | None = None) -> torch.Tensor:
        """h [R, H] (final-normalised) times the LM head; one row through the plain matrix."""
        if greedy_out is not None:
            return panel_product(h, self.lm_head_t, argmax=greedy_out)
        if h.shape[0] == 1 and self.lm_head_row_t is not None:
            return h @ self.lm_head_row_t
        return linear(h, self.lm_head_t)
