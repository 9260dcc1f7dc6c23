"""The forward step's rewritten pieces give transformers' bits: rotary embedding without the
rotate-half copy, RMSNorm with its fused weight, the in-place gated MLP product; the decode
gather index is computed once per step, and what only the torch attention path reads (decode
masks, a later prefill chunk's context slots and mask) is built only when that path runs;
freed host memory is kept (glibc); the KV cache and
large packed weights are advised onto huge pages (Linux)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from contbatch.engine import native
from contbatch.engine.attention import ChunkLayout, _head_block_index, build_metadata, paged_attention
from contbatch.engine.host_memory import HUGE_PAGE, huge_page_empty, retain_freed_memory
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


def _mixed_step() -> tuple[list[ChunkLayout], list[int]]:
    """Three decodes at different contexts, then a 6-token chunk after a 40-token prefix."""
    decodes = [ChunkLayout(i, 1, 20 + 7 * i, list(range(10 * i, 10 * i + 5))) for i in range(3)]
    return [*decodes, ChunkLayout(3, 6, 40, list(range(40, 44)))], [0, 1, 2, 8]


def test_torch_path_inputs_are_built_on_first_use_once() -> None:
    layouts, rows = _mixed_step()
    meta = build_metadata(layouts, rows, block_size=16, device=torch.device("cpu"))
    (group,), (prefill,) = meta.decode_groups, meta.prefills
    assert not group._derived and not prefill._derived  # nothing built yet
    assert group.mask is not None and group.mask is group.mask
    assert group.mask[:, 0, 0, :].sum(dim=1).tolist() == [21, 28, 35]  # each row's own context
    slots, mask = prefill.context_slots, prefill.mask
    assert slots is not None and mask is not None
    assert prefill.context_slots is slots and prefill.mask is mask
    assert slots.tolist() == [(40 + p // 16) * 16 + p % 16 for p in range(46)]  # positions 0..45, blocks 40..42
    assert mask.sum(dim=1).tolist() == list(range(41, 47))


@pytest.mark.skipif(native.native_library() is None, reason="the native kernels are off here")
def test_a_step_the_kernels_read_builds_no_torch_path_input() -> None:
    layouts, rows = _mixed_step()
    meta = build_metadata(layouts, rows, block_size=16, device=torch.device("cpu"))
    heads, kv_heads, dim = 4, 2, 8
    cache = (torch.zeros(64, 16, kv_heads, dim), torch.zeros(64, 16, kv_heads, dim))
    q, k, v = torch.randn(9, heads, dim), torch.randn(9, kv_heads, dim), torch.randn(9, kv_heads, dim)
    paged_attention(q, k, v, cache, meta, scale=dim**-0.5)
    (group,), (prefill,) = meta.decode_groups, meta.prefills
    assert not group._derived and not prefill._derived


def test_retain_freed_memory_applies_where_glibc_is() -> None:
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert retain_freed_memory() is on_glibc
    assert retain_freed_memory() is on_glibc  # once per process: a second call changes nothing


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(platform.system() != "Linux" or not THP.exists(), reason="transparent huge pages are Linux's")
def test_large_tensors_are_advised_onto_huge_pages() -> None:
    big = huge_page_empty((9, 1024, 1024), torch.float32)  # 36 MiB
    assert big.shape == (9, 1024, 1024) and big.dtype == torch.float32 and big.is_contiguous()
    assert big.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _vm_flags(big.data_ptr())  # MADV_HUGEPAGE: the kernel may back it with 2 MiB pages
    big.fill_(2.0)
    assert big.sum().item() == 2.0 * big.numel()
    small = huge_page_empty((256, 1024), torch.float32)  # 1 MiB: plain torch.empty (malloc's heap)
    assert small.shape == (256, 1024) and small.is_contiguous() and small.untyped_storage().nbytes() == 1024**2


def test_kv_cache_starts_zeroed_on_huge_pages() -> None:
    from types import SimpleNamespace

    from contbatch.engine.kv_cache import PagedKVCache

    spec = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16)  # (all the cache reads of a spec)
    cache = PagedKVCache(spec, num_blocks=4096, block_size=16)  # type: ignore[arg-type]  # 2x2x2x4096x16x16 floats: 32 MiB
    keys, values = cache.layer(1)
    assert not keys.any() and not values.any()
    if platform.system() == "Linux" and THP.exists():
        assert "hg" in _vm_flags(keys.data_ptr())
