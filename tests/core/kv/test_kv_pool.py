"""BlockPool: reference counts, the LRU free list, and the prefix-hash map."""

from __future__ import annotations

import pytest

from contbatch.core.kv import BlockPool, KVInvariantError
from contbatch.core.kv.invariants import check_pool


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(4, 16)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    assert pool.free_block_ids() == (0, 1, 2, 3)
    assert [pool.ref_count(b) for b in range(4)] == [0, 0, 0, 0]
    check_pool(pool, {}, "device")


def test_invalid_sizes_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        BlockPool(-1, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockPool(4, 0)
    assert BlockPool(0, 4).num_free_blocks == 0  # an empty host pool is allowed


def test_take_from_head_release_without_hash_to_head() -> None:
    pool = BlockPool(4, 1)
    assert pool.take(2) == [0, 1]
    assert pool.free_block_ids() == (2, 3)
    pool.release([1, 0])  # no hash: to the head, reused first, the first released at the very head
    assert pool.free_block_ids() == (1, 0, 2, 3)
    assert pool.take(3) == [1, 0, 2]
    check_pool(pool, {"a": [1, 0, 2]}, "device")


def test_take_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2, 1)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.take(3)
    assert pool.free_block_ids() == (0, 1)


def test_share_counts_holders_and_leaves_free_list() -> None:
    pool = BlockPool(3, 1, enable_prefix_caching=True)
    [block] = pool.take(1)
    pool.share(block)
    assert pool.ref_count(block) == 2
    pool.release([block])
    assert pool.ref_count(block) == 1 and block not in pool.free_block_ids()
    pool.release([block])
    assert pool.free_block_ids() == (0, 1, 2)
    pool.share(1)  # a free block taken out of the middle
    assert pool.free_block_ids() == (0, 2) and pool.ref_count(1) == 1
    pool.share(0)  # and one from the head
    assert pool.free_block_ids() == (2,) and pool.ref_count(0) == 1


def test_release_of_a_free_block_raises() -> None:
    pool = BlockPool(2, 1)
    with pytest.raises(ValueError, match="no holder"):
        pool.release([0])


def test_cache_keeps_first_block_and_eviction_drops_hash() -> None:
    pool = BlockPool(3, 1, enable_prefix_caching=True)
    a, b = pool.take(2)
    assert pool.cache(a, 11)
    assert not pool.cache(a, 11)  # already recorded
    assert not pool.cache(b, 11)  # hash taken by a: no duplicates
    assert not pool.cache(a, 12)  # a block records one hash
    assert pool.block_hash(a) == 11 and pool.block_hash(b) is None
    assert dict(pool.cached_block_ids()) == {11: a}
    pool.release([a, b])  # a (cached) to the tail, b (no hash) to the head
    assert pool.free_block_ids() == (b, 2, a)
    assert pool.match([11, 12], 5) == [a]  # free but still cached
    assert pool.take(2) == [b, 2] and pool.match([11], 5) == [a]
    assert pool.take(1) == [a]  # a evicted at the head's turn
    assert pool.block_hash(a) is None and pool.match([11], 5) == []
    assert pool.num_cached_blocks == 0


def test_cache_needs_prefix_caching_and_a_held_block() -> None:
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        BlockPool(2, 1).cache(0, 1)
    pool = BlockPool(2, 1, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="is free"):
        pool.cache(0, 1)


def test_match_stops_at_miss_limit_and_repeat() -> None:
    pool = BlockPool(4, 1, enable_prefix_caching=True)
    ids = pool.take(3)
    for block_id, block_hash in zip(ids, [1, 2, 3], strict=True):
        pool.cache(block_id, block_hash)
    assert pool.match([1, 2, 3], 10) == ids
    assert pool.match([1, 2, 3], 2) == ids[:2]
    assert pool.match([1, 9, 3], 10) == ids[:1]
    assert pool.match([1, 1, 2], 10) == ids[:1]  # never the same block twice
    assert pool.match([], 10) == []


def test_check_pool_detects_mismatches() -> None:
    pool = BlockPool(3, 1)
    pool.take(1)
    with pytest.raises(KVInvariantError, match="ref count 1 but 0 tables"):
        check_pool(pool, {}, "device")
    with pytest.raises(KVInvariantError, match="twice"):
        check_pool(pool, {"a": [0, 0]}, "device")
    with pytest.raises(KVInvariantError, match="unknown block 7"):
        check_pool(pool, {"a": [0, 7]}, "device")
    assert isinstance(KVInvariantError("x"), AssertionError)


def test_take_one_comes_from_the_head() -> None:
    pool = BlockPool(4, 1)
    assert pool.take(1) == [0]  # nothing released yet: from the queued list
    pool.take(2)
    pool.release([2, 0])
    assert pool.take(1) == [2] and pool.free_block_ids() == (0, 3)
    assert pool.take(1) == [0] and pool.take(1) == [3]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.take(1)
    check_pool(pool, {"a": [0, 1, 2, 3]}, "device")


def test_release_after_blocks_held_once_handles_a_shared_one_in_order() -> None:
    pool = BlockPool(4, 1, enable_prefix_caching=True)
    a, b, c = pool.take(3)
    pool.share(b)  # b held twice: the release's fast loop stops there
    pool.release([a, b, c])
    assert pool.ref_count(b) == 1 and pool.free_block_ids() == (a, c, 3)  # the first freed at the head
    check_pool(pool, {"x": [b]}, "device")


def test_release_failing_past_blocks_held_once_changes_nothing() -> None:
    pool = BlockPool(4, 1)
    a, b, c = pool.take(3)
    for refused in ([a, b, 3], [a, b, a], [a, c, c, b]):
        with pytest.raises(ValueError, match="no holder"):
            pool.release(refused)
        assert [pool.ref_count(x) for x in (a, b, c)] == [1, 1, 1] and pool.free_block_ids() == (3,)
    check_pool(pool, {"x": [a, b, c]}, "device")
