"""`KVCacheManager`: per-request block tables over a device `BlockPool` and a host (swap) pool.

What it owns: which blocks each request holds, in token order (block i holds token positions
[i * block_size, (i + 1) * block_size)), on the device or, once swapped out, on the host.

A request is known from its first granted `allocate` until `free`; it is then either resident
(a device table, possibly empty) or swapped out (a host table), never both.

Invariants (`check_invariants`, after every call in tests):
- device free + used == num_blocks; every block's ref count equals the number of tables
  holding it (prefix-cache hits are shared); no block twice in one table; the free list is
  exactly the ref-0 blocks; every cached hash maps to a block recording that hash;
- host blocks used == sum of host tables <= num_host_blocks;
- every call is all-or-nothing: a call that is not granted (`Grant.granted` / `SwapOut.swapped`
  False) or raises ValueError changes nothing.

The manager keeps a journal of table changes for the executor (`take_block_deltas`): for each
resident request whose table changed since the last call, the shortest its table was meanwhile
(`num_kept`) and the blocks after that. A request freed or swapped out leaves the journal (the
executor learns that from the step output's finished, preempted and swapped-out ids); one that
gets a fresh table (first allocation, swap-in) is journalled from 0.

Blocks of one request are released last-block-first, so its tail (the least shareable part of
a prefix) sits nearer the free-list head and is evicted before its leading blocks.

Cost: every call is O(blocks it hands out, shares, caches or releases), each in one bulk pool
call (`take`, `share_all`, `cache_all`, `release`: list slices and tight loops, see `BlockPool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contbatch.core.kv.invariants import KVInvariantError, check_pool, require
from contbatch.core.kv.pool import BlockPool


@dataclass(frozen=True, slots=True)
class Grant:
    granted: bool  # all-or-nothing: False means nothing changed
    new_block_ids: tuple[int, ...]  # blocks appended to the request's table, in order (empty if not granted)
    num_missing_blocks: int  # when not granted: how many more free blocks were needed (>= 1); else 0
    num_cached_blocks: int = 0  # prefix-cache hits: the first num_cached_blocks of new_block_ids

    def __init__(
        self, granted: bool, new_block_ids: tuple[int, ...], num_missing_blocks: int, num_cached_blocks: int = 0
    ) -> None:
        """Written out: compiled, a generated one runs as Python (`contbatch.compiled`)."""
        object.__setattr__(self, "granted", granted)
        object.__setattr__(self, "new_block_ids", new_block_ids)
        object.__setattr__(self, "num_missing_blocks", num_missing_blocks)
        object.__setattr__(self, "num_cached_blocks", num_cached_blocks)


@dataclass(frozen=True, slots=True)
class SwapOut:
    swapped: bool  # False: host pool too small, nothing changed
    device_block_ids: tuple[int, ...]  # device blocks whose contents move to host, in table order; released
    num_host_blocks: int  # host blocks now held for the request (== len(device_block_ids)); 0 if not swapped


# The hot path ("already holds enough") returns this shared object instead of building one.
_GRANTED_NOTHING = Grant(granted=True, new_block_ids=(), num_missing_blocks=0)
_NOT_SWAPPED = SwapOut(swapped=False, device_block_ids=(), num_host_blocks=0)


def _check_num_tokens(num_tokens: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")


class KVCacheManager:
    """Paged KV accounting for the scheduler; see the module docstring for the invariants."""

    __slots__ = (
        "_changed",
        "_host_pool",
        "_host_tables",
        "_num_hashed",
        "_pool",
        "_tables",
        "block_size",
        "enable_prefix_caching",
        "num_blocks",
        "num_host_blocks",
    )

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False, num_host_blocks: int = 0
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self._host_pool = BlockPool(num_host_blocks, block_size)
        self._tables: dict[str, list[int]] = {}  # resident requests: device block ids in token order
        self._host_tables: dict[str, list[int]] = {}  # swapped-out requests: host block ids in token order
        # Leading table entries already offered to the prefix cache, so cache_blocks is O(new full blocks).
        self._num_hashed: dict[str, int] = {}
        # request id -> the shortest its table has been since the last take_block_deltas()
        self._changed: dict[str, int] = {}

    # -- read-only views ---------------------------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        """The device pool (read it; mutate only through the manager)."""
        return self._pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        return (self.num_blocks - self._pool.num_free_blocks) / self.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self._host_pool.num_free_blocks

    def __contains__(self, request_id: object) -> bool:
        """Known: allocated (granted at least once) and not freed yet, resident or swapped out."""
        return request_id in self._tables or request_id in self._host_tables

    def num_blocks_for(self, num_tokens: int) -> int:
        _check_num_tokens(num_tokens)
        return -(-num_tokens // self.block_size)

    def num_held_blocks(self, request_id: str) -> int:
        """Device blocks held; 0 for an unknown or swapped-out request."""
        table = self._tables.get(request_id)
        return 0 if table is None else len(table)

    def num_held_host_blocks(self, request_id: str) -> int:
        table = self._host_tables.get(request_id)
        return 0 if table is None else len(table)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """Device block ids in token order; () for an unknown or swapped-out request."""
        return tuple(self._tables.get(request_id, ()))

    def host_block_table(self, request_id: str) -> tuple[int, ...]:
        """Host block ids in token order (pairs with `SwapOut.device_block_ids`); () unless swapped out."""
        return tuple(self._host_tables.get(request_id, ()))

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra device blocks the request needs to hold `num_tokens` tokens (0 if it holds enough)."""
        return max(0, self.num_blocks_for(num_tokens) - self.num_held_blocks(request_id))

    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading `block_hashes` are cached right now (0 without prefix caching). Read-only."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._pool.match(block_hashes, len(block_hashes)))

    def match_prefix_free(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """(how many leading `block_hashes` are cached, how many of those blocks are on the free
        list): sharing a free one still takes it off the free list. Read-only."""
        if not self.enable_prefix_caching:
            return 0, 0
        hit_ids = self._pool.match(block_hashes, len(block_hashes))
        return len(hit_ids), self._pool.count_free(hit_ids)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_tables

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, *, block_hashes: Sequence[int] = ()) -> Grant:
        """Make the request hold `num_blocks_for(num_tokens)` device blocks (grows only). All-or-nothing.

        On the request's first allocation (it holds no block yet) with prefix caching on, the
        blocks caching its leading `block_hashes` (one hash per full prompt block) are shared
        first and counted in `num_cached_blocks`; the rest come from the free-list head.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        num_needed = -(-num_tokens // self.block_size)
        table = self._tables.get(request_id)
        if table is not None:
            if num_needed <= len(table):
                return _GRANTED_NOTHING
            if table:
                return self._grow(request_id, table, num_needed - len(table))
        elif request_id in self._host_tables:
            raise ValueError(f"request {request_id!r} is swapped out: swap_in before allocate")
        return self._allocate_first(request_id, num_needed, block_hashes)

    def _grow(self, request_id: str, table: list[int], num_new: int) -> Grant:
        num_free = self._pool.num_free_blocks
        if num_new > num_free:
            return Grant(granted=False, new_block_ids=(), num_missing_blocks=num_new - num_free)
        if request_id not in self._changed:
            self._changed[request_id] = len(table)
        new_block_ids = self._pool.take(num_new)
        table.extend(new_block_ids)
        return Grant(granted=True, new_block_ids=tuple(new_block_ids), num_missing_blocks=0)

    def _allocate_first(self, request_id: str, num_needed: int, block_hashes: Sequence[int]) -> Grant:
        pool = self._pool
        hit_ids = pool.match(block_hashes, num_needed) if self.enable_prefix_caching and block_hashes else []
        num_fresh = num_needed - len(hit_ids)
        # A hit that is free still leaves the free list, so it counts against the free blocks.
        num_required = (num_fresh + pool.count_free(hit_ids)) if hit_ids else num_fresh
        if num_required > pool.num_free_blocks:
            return Grant(granted=False, new_block_ids=(), num_missing_blocks=num_required - pool.num_free_blocks)
        if hit_ids:
            pool.share_all(hit_ids)
            table = hit_ids + pool.take(num_fresh)
        else:
            table = pool.take(num_fresh)
        self._tables[request_id] = table
        self._changed[request_id] = 0
        if hit_ids:
            self._num_hashed[request_id] = len(hit_ids)
        if not table:
            return _GRANTED_NOTHING
        return Grant(granted=True, new_block_ids=tuple(table), num_missing_blocks=0, num_cached_blocks=len(hit_ids))

    def cache_blocks(self, request_id: str, block_hashes: Sequence[int], num_computed_tokens: int) -> None:
        """Register the hashes of the request's blocks that are now full (computed) and have a hash.

        Block i qualifies when (i + 1) * block_size <= num_computed_tokens and i < len(block_hashes).
        Idempotent; a hash already cached by another block keeps that block. No-op without prefix
        caching or for an unknown request; ValueError for a swapped-out one.
        """
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
        table = self._resident_table(request_id, "cache_blocks")
        if table is None or not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        start = self._num_hashed.get(request_id, 0)
        if num_full <= start:
            return
        self._pool.cache_all(table[start:num_full], block_hashes[start:num_full])
        self._num_hashed[request_id] = num_full

    # -- release -----------------------------------------------------------------------------

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Release the request's blocks beyond `num_blocks_for(num_tokens)`; return how many.

        For speculative-decoding rollback. 0 for an unknown request; ValueError for a swapped-out one.
        """
        num_keep = self.num_blocks_for(num_tokens)
        table = self._resident_table(request_id, "trim")
        if table is None or len(table) <= num_keep:
            return 0
        released_ids = table[num_keep:]
        self._changed[request_id] = min(self._changed.get(request_id, len(table)), num_keep)
        del table[num_keep:]
        released_ids.reverse()
        self._pool.release(released_ids)
        if self._num_hashed.get(request_id, 0) > num_keep:
            self._num_hashed[request_id] = num_keep
        return len(released_ids)

    def free(self, request_id: str) -> int:
        """Release every block (device and host) of the request and forget it.

        Returns the number of device blocks released (0 for an unknown request). A released block
        with a cached hash stays cached until it is evicted.
        """
        self._num_hashed.pop(request_id, None)
        self._changed.pop(request_id, None)
        host_table = self._host_tables.pop(request_id, None)
        if host_table is not None:
            self._host_pool.release(host_table)
        table = self._tables.pop(request_id, None)
        if table is None:
            return 0
        table.reverse()  # the table is forgotten: reversed in place for the release order
        self._pool.release(table)
        return len(table)

    # -- swapping ----------------------------------------------------------------------------

    def swap_out(self, request_id: str) -> SwapOut:
        """Move all the request's device blocks to host blocks if the host pool has room.

        The device blocks are released (cached hashes stay). `swapped=False`: nothing changed.
        ValueError for an unknown or already swapped-out request.
        """
        table = self._resident_table(request_id, "swap_out")
        if table is None:
            raise ValueError(f"swap_out of unknown request {request_id!r}")
        if len(table) > self._host_pool.num_free_blocks:
            return _NOT_SWAPPED
        self._host_tables[request_id] = self._host_pool.take(len(table))
        del self._tables[request_id]
        self._num_hashed.pop(request_id, None)
        self._changed.pop(request_id, None)
        self._pool.release(table[::-1])
        return SwapOut(swapped=True, device_block_ids=tuple(table), num_host_blocks=len(table))

    def swap_in(self, request_id: str) -> Grant:
        """Give a swapped-out request fresh device blocks for all its host blocks and release those.

        All-or-nothing; the prefix cache is not consulted. ValueError unless it is swapped out.
        """
        host_table = self._host_tables.get(request_id)
        if host_table is None:
            raise ValueError(f"swap_in of request {request_id!r}, which is not swapped out")
        num_free = self._pool.num_free_blocks
        if len(host_table) > num_free:
            return Grant(granted=False, new_block_ids=(), num_missing_blocks=len(host_table) - num_free)
        table = self._pool.take(len(host_table))
        self._tables[request_id] = table
        self._changed[request_id] = 0
        del self._host_tables[request_id]
        self._host_pool.release(host_table)
        return Grant(granted=True, new_block_ids=tuple(table), num_missing_blocks=0)

    def _resident_table(self, request_id: str, operation: str) -> list[int] | None:
        """The request's device table; None if unknown; ValueError if swapped out."""
        table = self._tables.get(request_id)
        if table is None and request_id in self._host_tables:
            raise ValueError(f"{operation} of request {request_id!r}, which is swapped out")
        return table

    # -- the executor's journal ----------------------------------------------------------------

    def take_block_deltas(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """(request id, blocks kept, blocks added) for every resident request whose table changed
        since the previous call, in the order of their first change; clears the journal."""
        changed, self._changed = self._changed, {}
        tables = self._tables
        return [(rid, kept, tuple(tables[rid][kept:])) for rid, kept in changed.items()]

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `KVInvariantError` naming the first violated invariant (see the module docstring)."""
        both = self._tables.keys() & self._host_tables.keys()
        require(not both, f"requests both resident and swapped out: {sorted(both)}")
        check_pool(self._pool, self._tables, "device")
        check_pool(self._host_pool, self._host_tables, "host")
        num_host_held = sum(len(t) for t in self._host_tables.values())
        require(
            self._host_pool.num_used_blocks == num_host_held <= self.num_host_blocks,
            f"host: {self._host_pool.num_used_blocks} used, {num_host_held} held, {self.num_host_blocks} total",
        )
        for request_id, num_hashed in self._num_hashed.items():
            table = self._tables.get(request_id)
            require(table is not None and num_hashed <= len(table), f"{request_id!r}: stale prefix-cache cursor")


__all__ = ["Grant", "KVCacheManager", "KVInvariantError", "SwapOut"]
