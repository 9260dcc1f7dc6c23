"""The forward step's rewritten pieces give transformers' bits: rotary embedding without the
rotate-half copy, RMSNorm with its fused weight, the in-place gated MLP product; the decode
gather index is computed once per step; freed host memory is kept (glibc)."""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

from contbatch.engine.attention import ChunkLayout, _head_block_index, build_metadata
from contbatch.engine.host_memory import retain_freed_memory
from contbatch.engine.rope import apply_rotary


def _cos_sin(num_tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(num_tokens).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: the reference `apply_rotary` is held to."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_apply_rotary_matches_rotate_half_bitwise() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(37, 10 * 64) * 3
    x = qkv[:, : 8 * 64].view(37, 8, 64)  # a strided view, as the model passes it
    cos, sin = _cos_sin(37, 64)
    expected = x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
    assert torch.equal(apply_rotary(x, cos, sin), expected)


def test_fused_rms_norm_weight_is_the_same_product() -> None:
    torch.manual_seed(1)
    x, w = torch.randn(64, 384) * 2, torch.randn(384)
    assert torch.equal(F.rms_norm(x, (384,), w, eps=1e-5), w * F.rms_norm(x, (384,), eps=1e-5))


def test_in_place_gated_product_is_the_same() -> None:
    torch.manual_seed(2)
    gate, up = torch.randn(16, 2 * 96).chunk(2, dim=-1)
    assert torch.equal(F.silu(gate).mul_(up), F.silu(gate) * up)


def test_decode_gather_index_is_computed_once_per_group() -> None:
    layouts = [ChunkLayout(i, 1, 20 + 7 * i, list(range(10 * i, 10 * i + 5))) for i in range(3)]
    meta = build_metadata(layouts, [0, 1, 2], block_size=16, device=torch.device("cpu"))
    (group,) = meta.decode_groups
    index = group.gather_index(2, 64)
    assert torch.equal(index, _head_block_index(group.block_ids, 2, 64))
    assert group.gather_index(2, 64) is index
    assert torch.equal(group.gather_index(3, 32), _head_block_index(group.block_ids, 3, 32))


def test_retain_freed_memory_applies_where_glibc_is() -> None:
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert retain_freed_memory() is on_glibc
    assert retain_freed_memory() is on_glibc  # once per process: a second call changes nothing
