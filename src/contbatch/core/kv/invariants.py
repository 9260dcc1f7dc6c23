"""Invariant checks for the KV block layer: a `BlockPool` against the tables that hold its blocks.

Raises `KVInvariantError` naming the first violation. Cheap enough for tests (O(blocks + table
entries)), never called on the hot path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from contbatch.core.kv.pool import BlockPool


class KVInvariantError(AssertionError):
    """A KV block invariant does not hold."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise KVInvariantError(message)


def check_pool(pool: BlockPool, tables: Mapping[str, Sequence[int]], name: str) -> None:
    """`pool`'s counts, free list and hash map agree with `tables` (request id -> block ids held).

    - no block twice in one table, and every id is a block of the pool;
    - every block's ref count equals the number of tables holding it;
    - the free list is exactly the ref-0 blocks, each once; free + used == total;
    - every cached hash maps to a block recording that hash, and vice versa;
    - the free list's storage is consistent (`BlockPool.layout_errors`).
    """
    num_holders = _count_holders(pool, tables, name)
    for block_id in range(pool.num_blocks):
        ref_count = pool.ref_count(block_id)
        held = num_holders[block_id]
        require(ref_count == held, f"{name} block {block_id}: ref count {ref_count} but {held} tables hold it")
    _check_free_list(pool, name)
    _check_hashes(pool, name)
    errors = pool.layout_errors()
    require(not errors, f"{name} free list storage: {'; '.join(errors)}")


def _count_holders(pool: BlockPool, tables: Mapping[str, Sequence[int]], name: str) -> Counter[int]:
    num_holders: Counter[int] = Counter()
    for request_id, block_ids in tables.items():
        require(len(set(block_ids)) == len(block_ids), f"{name}: {request_id!r} holds a block twice: {block_ids}")
        for block_id in block_ids:
            require(0 <= block_id < pool.num_blocks, f"{name}: {request_id!r} holds unknown block {block_id}")
        num_holders.update(block_ids)
    return num_holders


def _check_free_list(pool: BlockPool, name: str) -> None:
    free_ids = pool.free_block_ids()
    require(len(set(free_ids)) == len(free_ids), f"{name}: a block is on the free list twice")
    unreferenced = {b for b in range(pool.num_blocks) if pool.ref_count(b) == 0}
    require(
        set(free_ids) == unreferenced, f"{name}: free list {sorted(free_ids)} != ref-0 blocks {sorted(unreferenced)}"
    )
    num_used = pool.num_blocks - len(unreferenced)
    require(
        pool.num_free_blocks + num_used == pool.num_blocks,
        f"{name}: free {pool.num_free_blocks} + used {num_used} != total {pool.num_blocks}",
    )


def _check_hashes(pool: BlockPool, name: str) -> None:
    cached = pool.cached_block_ids()
    require(pool.enable_prefix_caching or not cached, f"{name}: hashes cached with prefix caching off")
    for block_hash, block_id in cached.items():
        recorded = pool.block_hash(block_id)
        require(recorded == block_hash, f"{name}: hash {block_hash} maps to block {block_id} recording {recorded}")
    num_recording = sum(1 for b in range(pool.num_blocks) if pool.block_hash(b) is not None)
    require(
        num_recording == len(cached) == pool.num_cached_blocks,
        f"{name}: {num_recording} blocks record a hash but {len(cached)} hashes are cached",
    )
