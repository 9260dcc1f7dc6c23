"""Paged attention over a flat batch that mixes prefill chunks and decodes.

What it owns: `AttentionMetadata` (built once per step, read by every layer) and
`paged_attention` (one call per layer).

The flat batch is a sequence of chunks; chunk c covers flat tokens [token_begin, token_begin +
num_tokens) at positions [start, start + num_tokens) of its request. Every chunk attends
causally within itself and fully over its request's cached prefix [0, start), read from the
paged cache through its block table. Single-token chunks (decodes, or the last token of a
chunked prefill) that are adjacent in the flat batch form decode groups: one padded
scaled-dot-product call per group, keys and values gathered block-wise once per layer (one
`index_select` each, of whole blocks of one head, by an index computed once per step:
`DecodeGroup.gather_index`; with `PagedKVCache`'s head-major storage each request's keys of one
head come out as one contiguous [tokens, head_dim] run, the layout the
attention kernel reads fastest), cut to the group's longest context, shorter rows masked (no mask
when every row has the same context); the query heads that share a KV head are folded into that
head's query rows, so the call is plain (not grouped-query) attention. The runner puts them first
and sorted by context length, so groups pad little. On the CPU in float32 the native kernel
(`contbatch.engine.native`) reads a group's rows instead, each over its own keys where they lie
(`DecodeGroup.key_lo`, `key_hi`): no gather, no padding, no mask; the same output to float32
rounding. Likewise a prefill chunk without a sliding window (`PrefillChunk.block_ids`): the
kernel reads its keys, the cached prefix and its own, from its blocks. The torch path remains
wherever the kernel is off; what only it reads (the groups' masks and gather index, a later
prefill chunk's context slots and mask) is built on first use, so a step the kernels read builds
none of it.

Sliding windows: `windowed(meta, w)` is the same step for a layer whose queries see only the last
`w` positions (the query at i attends to keys j with i - w < j <= i, transformers' rule). Its
decode groups gather only the blocks that hold those keys, and its prefill chunks read only the
cached keys from position `start - w + 1` on, each with a mask of the window (a chunk that starts
at 0 and fits in the window keeps plain causal attention). Blocks that fell out of every window
stay allocated (the KV cache manager is not told).

Kernels on CUDA: `attention_kernels` limits scaled-dot-product attention to backends whose
kernels are built ahead (flash, memory-efficient, math). PyTorch's first choice for half
precision on Hopper, cuDNN's, builds an execution plan for each new shape, and a server meets a
new shape at almost every step (prompt lengths, growing decode contexts): on an H200,
`benchmarks/gpu_dtypes.py`'s bfloat16 work on new shapes took 9.5 s with cuDNN's attention and
0.48 s with these (`benchmarks/results/gpu_dtypes_h200.json`).

Invariants: the new tokens' K/V are written to the cache before any read, so a chunk sees its own
keys; a slot is written by at most one token per step; no query row is fully masked (a window
always holds the query's own position).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from contbatch.engine.native import paged_decode, paged_prefill

# A decode group is split when a request needs this many times the blocks of the group's first
# (shortest) one, bounding padding waste; below `_MIN_SPLIT_BLOCKS` extra blocks it never splits.
_SPLIT_RATIO = 2
_MIN_SPLIT_BLOCKS = 4


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """One chunk of the flat batch, as the runner placed it."""

    token_begin: int  # first flat token index
    num_tokens: int  # >= 1
    start: int  # position of its first token (tokens before it are in the cache)
    block_table: Sequence[int]  # the request's device blocks in token order; covers start + num_tokens
    num_prompt_tokens: int | None = None  # its request's prompt length (dynamic NTK RoPE); None or 0: not given


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    token_begin: int
    token_end: int  # single-token chunks [token_begin, token_end), one per request
    block_ids: torch.Tensor  # [B, max_blocks] long, padded with block 0
    num_keys: int  # keys read per row: the gathered blocks' first num_keys positions (<= max_blocks * block_size)
    # [B] long each: row b attends to the positions [key_lo[b], key_hi[b]) of its blocks block_ids[b]
    # (what the native kernel reads, `contbatch.engine.native`; the torch path reads `mask`)
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    masked: bool  # some row attends to less than [0, num_keys): the torch path needs `mask`
    # what only the torch path reads, built on first use and kept for the step's other layers:
    # "mask", and (num_kv_heads, num_blocks) -> `gather_index`
    _derived: dict[object, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, 1, num_keys] bool, True = attend: [key_lo, key_hi) of each row; None when every
        row attends to all num_keys."""
        if not self.masked:
            return None
        mask = self._derived.get("mask")
        if mask is None:
            keys = torch.arange(self.num_keys, device=self.key_lo.device)[None, :]
            visible = (keys >= self.key_lo[:, None]) & (keys < self.key_hi[:, None])
            mask = self._derived["mask"] = visible[:, None, None, :]
        return mask

    def gather_index(self, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
        """`_head_block_index(self.block_ids, num_kv_heads, num_blocks)`, computed once per step."""
        key = (num_kv_heads, num_blocks)
        index = self._derived.get(key)
        if index is None:
            index = self._derived[key] = _head_block_index(self.block_ids, num_kv_heads, num_blocks)
        return index


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A chunk of at least two tokens: its queries attend causally (within `window`, when set)
    to its request's cached prefix and to its own keys. The native kernel reads `block_ids`;
    the torch path reads `context_slots` and `mask`, built on first use."""

    token_begin: int
    num_tokens: int  # >= 2
    start: int  # the position of its first token
    block_table: Sequence[int]  # its request's device blocks; cover [0, start + num_tokens)
    block_size: int
    device: torch.device
    window: int | None = None
    # [blocks] long: its request's blocks holding positions [0, start + num_tokens) (what the
    # native kernel reads for plain causal attention, `contbatch.engine.native.paged_prefill`);
    # None under a sliding window or off the CPU (the torch path runs)
    block_ids: torch.Tensor | None = None
    _derived: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def first_key(self) -> int:
        """The first position any of its queries sees."""
        return 0 if self.window is None else max(0, self.start - self.window + 1)

    @property
    def context_slots(self) -> torch.Tensor | None:
        """[keys] long: the cache slots of positions [first_key, start + num_tokens); None when it
        starts at 0 (its own new keys are all it reads)."""
        if self.start == 0:
            return None
        slots = self._derived.get("slots")
        if slots is None:
            first, end = self.first_key, self.start + self.num_tokens
            layout = ChunkLayout(0, end - first, first, self.block_table)
            slots = self._derived["slots"] = torch.tensor(chunk_slots(layout, self.block_size), device=self.device)
        return slots

    @property
    def mask(self) -> torch.Tensor | None:
        """[num_tokens, keys] bool, True = attend; None: plain causal attention over its own keys
        (it starts at 0 and fits in the window)."""
        if self.start == 0 and (self.window is None or self.num_tokens <= self.window):
            return None
        mask = self._derived.get("mask")
        if mask is None:
            end = self.start + self.num_tokens
            rows = torch.arange(self.start, end, device=self.device)[:, None]
            keys = torch.arange(self.first_key, end, device=self.device)[None, :]
            mask = keys <= rows
            if self.window is not None:
                mask &= keys > rows - self.window
            self._derived["mask"] = mask
        return mask


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each flat token's new K/V
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    chunk_spans: tuple[tuple[int, int, int], ...]  # (token_begin, token_end, start + num_tokens) per chunk
    sample_indices: torch.Tensor  # [R] long: flat tokens whose logits are returned, in row order
    num_tokens: int  # T
    layouts: tuple[ChunkLayout, ...] = ()  # the chunks, as given
    block_size: int = 1
    window: int | None = None  # the sliding window its attention applies (None: full causal)


def chunk_slots(layout: ChunkLayout, block_size: int, end: int | None = None) -> list[int]:
    """Cache slots of positions [layout.start, end) (end defaults to the chunk's end)."""
    end = layout.start + layout.num_tokens if end is None else end
    table = layout.block_table
    if -(-end // block_size) > len(table):
        raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens (block size {block_size})")
    return [table[p // block_size] * block_size + p % block_size for p in range(layout.start, end)]


def _decode_groups(layouts: Sequence[ChunkLayout]) -> list[list[ChunkLayout]]:
    """Maximal runs of adjacent single-token chunks, split where padding would exceed the ratio."""
    groups: list[list[ChunkLayout]] = []
    previous_end = -1
    for c in layouts:
        if c.num_tokens != 1:
            previous_end = -1
            continue
        num_blocks = len(c.block_table)
        if groups and previous_end == c.token_begin:
            first = len(groups[-1][0].block_table)
            if not (num_blocks > _SPLIT_RATIO * first and num_blocks - first >= _MIN_SPLIT_BLOCKS):
                groups[-1].append(c)
                previous_end = c.token_begin + 1
                continue
        groups.append([c])
        previous_end = c.token_begin + 1
    return groups


def _build_decode_group(
    group: list[ChunkLayout], block_size: int, device: torch.device, window: int | None = None
) -> DecodeGroup:
    """Rows gather the blocks holding keys [first, context) (first = context - window, or 0),
    padded; they read the first `num_keys` gathered positions (the longest row's keys)."""
    context_lens = [c.start + 1 for c in group]
    firsts = [0 if window is None else max(0, n - window) for n in context_lens]
    offsets = [f // block_size * block_size for f in firsts]  # position of each row's first gathered key
    num_blocks = [-(-n // block_size) - o // block_size for n, o in zip(context_lens, offsets, strict=True)]
    width = max(num_blocks)
    rows = [
        list(c.block_table[o // block_size : o // block_size + nb]) + [0] * (width - nb)
        for c, o, nb in zip(group, offsets, num_blocks, strict=True)
    ]
    block_ids = torch.tensor(rows, dtype=torch.long, device=device)
    lo = [f - o for f, o in zip(firsts, offsets, strict=True)]
    hi = [n - o for n, o in zip(context_lens, offsets, strict=True)]
    num_keys = max(hi)
    masked = any(lo) or min(hi) != num_keys
    begin = group[0].token_begin
    key_lo, key_hi = torch.tensor(lo, device=device), torch.tensor(hi, device=device)
    return DecodeGroup(begin, begin + len(group), block_ids, num_keys, key_lo, key_hi, masked)


def _build_prefill(c: ChunkLayout, block_size: int, device: torch.device, window: int | None = None) -> PrefillChunk:
    blocks = None
    if window is None and device.type == "cpu":  # (what only the native kernel reads: no copy to a GPU)
        end = c.start + c.num_tokens
        blocks = torch.tensor(list(c.block_table[: -(-end // block_size)]), dtype=torch.long, device=device)
    return PrefillChunk(c.token_begin, c.num_tokens, c.start, c.block_table, block_size, device, window, blocks)


def build_metadata(
    layouts: Sequence[ChunkLayout], sample_indices: Sequence[int], *, block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata for one step. `layouts` tile the flat batch in order (token_begin increasing, no gaps)."""
    slots: list[int] = []
    for c in layouts:
        if c.token_begin != len(slots):
            raise ValueError(
                f"chunk layouts must tile the flat batch: expected token {len(slots)}, got {c.token_begin}"
            )
        slots.extend(chunk_slots(c, block_size))
    if len(set(slots)) != len(slots):
        raise ValueError("two tokens of one step write the same KV cache slot")
    groups = tuple(_build_decode_group(g, block_size, device) for g in _decode_groups(layouts))
    prefills = tuple(_build_prefill(c, block_size, device) for c in layouts if c.num_tokens > 1)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode_groups=groups,
        prefills=prefills,
        chunk_spans=tuple((c.token_begin, c.token_begin + c.num_tokens, c.start + c.num_tokens) for c in layouts),
        sample_indices=torch.tensor(list(sample_indices), dtype=torch.long, device=device),
        num_tokens=len(slots),
        layouts=tuple(layouts),
        block_size=block_size,
    )


def windowed(meta: AttentionMetadata, window: int | None) -> AttentionMetadata:
    """`meta` for a layer with a sliding window of `window` positions (`meta` itself when no query
    of the step is `window` or more positions past a key, or `window` is None)."""
    if window is None or window == meta.window or all(c.start + c.num_tokens <= window for c in meta.layouts):
        return meta
    device = meta.slot_mapping.device
    bs = meta.block_size
    groups = tuple(_build_decode_group(g, bs, device, window) for g in _decode_groups(meta.layouts))
    prefills = tuple(_build_prefill(c, bs, device, window) for c in meta.layouts if c.num_tokens > 1)
    return dataclasses.replace(meta, decode_groups=groups, prefills=prefills, window=window)


# scaled-dot-product backends whose kernels need no per-shape build (module docstring); None: torch's choice
CUDA_ATTENTION_BACKENDS: tuple[SDPBackend, ...] | None = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Around a forward pass: on CUDA, scaled-dot-product attention restricted to
    `CUDA_ATTENTION_BACKENDS`; elsewhere nothing changes."""
    if device.type != "cuda" or CUDA_ATTENTION_BACKENDS is None:
        return contextlib.nullcontext()
    return sdpa_kernel(list(CUDA_ATTENTION_BACKENDS))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Hq, n, d]; k, v [B, Hkv, L, d]; grouped-query heads without materialising repeated K/V."""
    gqa = q.shape[1] != k.shape[1]
    causal = mask is None and q.shape[2] > 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """A key or value cache [num_blocks, block_size, Hkv, d] as [Hkv, num_blocks * block_size, d]:
    a view of `PagedKVCache`'s head-major storage (a copy of any other layout: right, but slow)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.permute(2, 0, 1, 3).contiguous().view(num_kv_heads, num_blocks * block_size, head_dim)


def _head_block_index(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of `head_major(cache).view(Hkv * num_blocks, ...)` holding blocks `block_ids` [B, W],
    head by head: head h's copy of block b is row h * num_blocks + b (the same for keys and values)."""
    heads = torch.arange(0, num_kv_heads * num_blocks, num_blocks, device=block_ids.device)
    return (heads[:, None] + block_ids.view(1, -1)).view(-1)


def _gather_blocks(cache: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """The blocks `_head_block_index` names, of `rows` requests, of a cache [num_blocks,
    block_size, Hkv, d], every head's in token order: [rows, Hkv, W * block_size, d], each [row,
    head] one contiguous run."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    blocks = head_major(cache).view(num_kv_heads * num_blocks, block_size * head_dim)
    gathered = blocks.index_select(0, index).view(num_kv_heads, rows, -1, head_dim)
    return gathered.transpose(0, 1)


def _decode_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of one query token per row: q [B, Hq, d]; k, v [B, Hkv, L, d]; output [B, Hq, d].

    Query head i reads KV head i // (Hq / Hkv) (transformers' `repeat_kv`), so the query heads of
    one KV head are folded into that head's query rows, [B, Hkv, Hq / Hkv, d]: plain attention
    without a causal mask (every folded row is the same position and sees the same keys), which
    scaled-dot-product attention runs in fewer, larger blocks than `enable_gqa` with one query
    row per head (about 40 % less attention time for 32 rows of the demo model on CPU).
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    folded = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return o.reshape(rows, num_heads, head_dim)  # a view unless the kernel wrote [B, n, H, d] memory order


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    *,
    scale: float,
) -> torch.Tensor:
    """Attention output [T, num_heads, head_dim] for q [T, num_heads, head_dim], new k, v [T, num_kv_heads, head_dim].

    Writes k, v into `cache` (key, value caches [num_blocks, block_size, num_kv_heads, head_dim];
    `PagedKVCache.layer`'s head-major views are read without a copy) first.
    """
    key_cache, value_cache = cache
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    for c, new in ((key_cache, k), (value_cache, v)):
        c.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new)
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        span = slice(g.token_begin, g.token_end)
        where = {"block_ids": g.block_ids, "lo": g.key_lo, "hi": g.key_hi}
        if paged_decode(q[span], key_cache, value_cache, **where, scale=scale, out=out[span]):
            continue  # read in place by the native kernel
        rows = g.block_ids.shape[0]
        index = g.gather_index(num_kv_heads, num_blocks)  # one index for keys and values, and every layer
        keys = _gather_blocks(key_cache, index, rows)[:, :, : g.num_keys]
        values = _gather_blocks(value_cache, index, rows)[:, :, : g.num_keys]
        out[g.token_begin : g.token_end] = _decode_sdpa(q[g.token_begin : g.token_end], keys, values, g.mask, scale)
    for p in meta.prefills:
        end = p.token_begin + p.num_tokens
        native = p.block_ids is not None and paged_prefill(
            q[p.token_begin : end], key_cache, value_cache, block_ids=p.block_ids, start=p.start, scale=scale,
            out=out[p.token_begin : end],
        )  # fmt: skip
        if native:
            continue  # read in place by the native kernel
        if p.context_slots is None:
            keys, values = k[p.token_begin : end].transpose(0, 1), v[p.token_begin : end].transpose(0, 1)
        else:
            keys = head_major(key_cache).index_select(1, p.context_slots)
            values = head_major(value_cache).index_select(1, p.context_slots)
        query = q[p.token_begin : end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, d]
        o = _sdpa(query, keys.unsqueeze(0), values.unsqueeze(0), p.mask, scale)
        out[p.token_begin : end] = o[0].transpose(0, 1)
    return out
