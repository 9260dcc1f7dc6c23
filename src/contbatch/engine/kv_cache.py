"""`PagedKVCache`: the device memory behind the core's KV block tables, and its host swap space.

What it owns: one tensor, stored head-major: [num_layers, 2 (key, value), num_kv_heads,
num_blocks, block_size, head_dim], so that one head's keys in one block are one contiguous run and
paged attention gathers a request's keys per head as contiguous [tokens, head_dim] rows
(`contbatch.engine.attention.head_major`). `layer(i)` returns that layer's key and value caches
as views in token order, each [num_blocks, block_size, num_kv_heads, head_dim] (strided, not
contiguous). Token position p of a request whose block table is `table` lives in slot
`table[p // block_size] * block_size + p % block_size` (the core's `KVCacheManager` layout).

Swapping really moves data: `swap_out(request_id, device_block_ids)` copies those blocks (all
layers, keys and values) to host memory keyed by the request id; `swap_in(request_id,
new_device_block_ids)` copies them into the new blocks (same count, same token order) and drops
the host copy. Invariant: a request has at most one host copy; `swap_in` of an unknown request,
or with a different block count, raises `ValueError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contbatch.engine.device import resolve_device
from contbatch.engine.host_memory import huge_page_empty
from contbatch.engine.spec import ModelSpec

_BLOCK_DIM = 3  # the block axis of the storage [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize


def num_blocks_for_memory(spec: ModelSpec, memory_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks fit in `memory_bytes` (floor); ValueError if not even one does."""
    per_block = bytes_per_block(spec, block_size, dtype)
    num_blocks = memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV memory {memory_bytes} bytes holds no block of {per_block} bytes (block_size {block_size})"
        )
    return int(num_blocks)


class PagedKVCache:
    """Paged keys and values for every layer; see the module docstring for the layout and swap rules."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = resolve_device(device)
        shape = (spec.num_layers, 2, spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
        if self.device.type == "cpu":
            self._kv = huge_page_empty(shape, dtype).zero_()  # (see `huge_page_empty`: blocks read scattered)
        else:
            self._kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self._host: dict[str, torch.Tensor] = {}

    @classmethod
    def for_memory(
        cls,
        spec: ModelSpec,
        memory_bytes: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        num_blocks = num_blocks_for_memory(spec, memory_bytes, block_size, dtype)
        return cls(spec, num_blocks, block_size, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self._kv.numel() * self._kv.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key cache, value cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim] (views)."""
        keys, values = self._kv[index].permute(0, 2, 3, 1, 4)
        return keys, values

    # -- swap ------------------------------------------------------------------------------

    @property
    def swapped_ids(self) -> tuple[str, ...]:
        return tuple(self._host)

    def _block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block ids {list(block_ids)} out of range [0, {self.num_blocks})")
        return ids.to(self.device)

    def swap_out(self, request_id: str, device_block_ids: Sequence[int]) -> None:
        """Copy the blocks' contents (token order) to host memory under `request_id`."""
        if request_id in self._host:
            raise ValueError(f"request {request_id!r} is already swapped out")
        index = self._block_index(device_block_ids)
        blocks = self._kv.index_select(_BLOCK_DIM, index)
        if self.device.type == "cpu":
            self._host[request_id] = blocks  # index_select already made a separate copy
        else:
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
            host.copy_(blocks)
            self._host[request_id] = host

    def swap_in(self, request_id: str, new_device_block_ids: Sequence[int]) -> None:
        """Copy the request's host copy into `new_device_block_ids` (same count) and drop the host copy."""
        host = self._host.get(request_id)
        if host is None:
            raise ValueError(f"request {request_id!r} has no swapped-out KV to swap in")
        if host.shape[_BLOCK_DIM] != len(new_device_block_ids):
            raise ValueError(
                f"request {request_id!r}: swapped out {host.shape[_BLOCK_DIM]} blocks, "
                f"swap_in got {len(new_device_block_ids)}"
            )
        index = self._block_index(new_device_block_ids)
        self._kv.index_copy_(_BLOCK_DIM, index, host.to(self.device, non_blocking=True))
        del self._host[request_id]

    def drop_swapped(self, request_id: str) -> bool:
        """Forget a host copy (the request finished while swapped out); True if there was one."""
        return self._host.pop(request_id, None) is not None
