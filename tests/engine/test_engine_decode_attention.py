"""Decode attention over the paged cache equals plain attention of each request over its own keys.

Both decode paths: the native kernel reading each row's keys where they lie
(`contbatch.engine.native`), and the torch path, which folds the query heads that share a KV head
into that head's query rows (one plain scaled-dot-product call per group over the gathered,
padded, masked blocks). These tests compare each, request by request, with attention computed the
way transformers does (K/V heads repeated for their query heads, softmax over the request's keys
only), for grouped-query, multi-query and multi-head shapes, with rows of different context
lengths in one group and with a sliding window.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from contbatch.engine.attention import ChunkLayout, build_metadata, chunk_slots, paged_attention, windowed
from contbatch.engine.native import native_library

BLOCK_SIZE = 4


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, d]; keys, values [L, Hkv, d]: softmax(q k^T * scale) v per query head, KV heads repeated."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, d]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    weights = torch.softmax((q[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)  # [Hq, L]
    return (weights[:, None, :] @ v).squeeze(1)


def _caches(num_blocks: int, num_kv_heads: int, head_dim: int, head_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key and value caches [num_blocks, BLOCK_SIZE, Hkv, d]: contiguous, or views of a
    head-major [2, Hkv, num_blocks, BLOCK_SIZE, d] tensor, as `PagedKVCache.layer` returns them."""
    if not head_major:
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        return torch.randn(shape), torch.randn(shape)
    keys, values = torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim).permute(0, 2, 3, 1, 4)
    return keys, values


@pytest.fixture(params=["native", "torch"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode rows read by the native kernel (`contbatch.engine.native`; it must be available
    wherever a C compiler is) or by the torch path (gather, pad, mask, scaled-dot-product)."""
    if request.param == "torch":
        monkeypatch.setattr("contbatch.engine.attention.paged_decode", lambda *args, **kwargs: False)
    elif native_library() is None:
        assert shutil.which(os.environ.get("CC", "cc")) is None, "a C compiler is here but the kernel is off"
        pytest.skip("no C compiler: the native kernel is off")
    return str(request.param)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("same_context", [False, True])
@pytest.mark.usefixtures("decode_path")
def test_decode_groups_match_per_request_attention(
    num_heads: int, num_kv_heads: int, window: int | None, head_major: bool, same_context: bool
) -> None:
    """Rows of different contexts (padded, masked) or all of one context (no mask without a window)."""
    rng = random.Random(num_heads * 10 + num_kv_heads)
    torch.manual_seed(0)
    head_dim, num_blocks = 8, 64
    key_cache, value_cache = _caches(num_blocks, num_kv_heads, head_dim, head_major)
    free = list(range(num_blocks))
    rng.shuffle(free)
    layouts = []
    starts = [9] * 5 if same_context else sorted(rng.randrange(0, 13) for _ in range(5))  # contexts 1-13
    for i, start in enumerate(starts):
        table = [free.pop() for _ in range(start // BLOCK_SIZE + 1)]
        layouts.append(ChunkLayout(i, 1, start, table))
    meta = build_metadata(layouts, range(len(layouts)), block_size=BLOCK_SIZE, device=torch.device("cpu"))
    meta = windowed(meta, window)
    assert meta.decode_groups, "single-token chunks form decode groups"
    assert (meta.decode_groups[0].mask is None) == (same_context and window is None)
    q = torch.randn(len(layouts), num_heads, head_dim)
    k = torch.randn(len(layouts), num_kv_heads, head_dim)
    v = torch.randn(len(layouts), num_kv_heads, head_dim)
    scale = head_dim**-0.5

    out = paged_attention(q, k, v, (key_cache, value_cache), meta, scale=scale)

    flat_keys = key_cache.reshape(-1, num_kv_heads, head_dim)
    flat_values = value_cache.reshape(-1, num_kv_heads, head_dim)
    for row, c in enumerate(layouts):
        first = 0 if window is None else max(0, c.start + 1 - window)
        slots = torch.tensor(chunk_slots(ChunkLayout(0, c.start + 1 - first, first, c.block_table), BLOCK_SIZE))
        torch.testing.assert_close(flat_keys[slots[-1]], k[row])  # the new key was written first
        want = _reference(q[row], flat_keys[slots], flat_values[slots], scale)
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5, msg=f"row {row} start {c.start}")
