"""Prefix caching: reuse across requests, ref counts, a fully cached prompt, LRU eviction."""

from __future__ import annotations

import pytest

from contbatch.core.kv import Grant, KVCacheManager


def make(num_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)


def test_cache_blocks_registers_only_full_computed_hashed_blocks() -> None:
    kv = make()
    kv.allocate("a", 14)  # 4 blocks: 0..3
    kv.cache_blocks("a", [10, 11, 12], 7)  # only block 0 is full
    assert dict(kv.pool.cached_block_ids()) == {10: 0}
    kv.cache_blocks("a", [10, 11, 12], 14)  # blocks 0..2 full, block 3 has no hash
    assert dict(kv.pool.cached_block_ids()) == {10: 0, 11: 1, 12: 2}
    kv.cache_blocks("a", [10, 11, 12], 14)  # idempotent
    assert dict(kv.pool.cached_block_ids()) == {10: 0, 11: 1, 12: 2}
    assert kv.match_prefix([10, 11, 12, 13]) == 3
    assert kv.match_prefix([99, 10, 11]) == 0  # leading hashes only: a miss stops the match
    kv.check_invariants()


def test_cache_blocks_of_unknown_request_is_a_no_op() -> None:
    kv = make()
    kv.cache_blocks("nobody", [1, 2], 8)
    assert kv.pool.num_cached_blocks == 0


def test_duplicate_hash_keeps_the_first_block() -> None:
    kv = make()
    kv.allocate("a", 4)
    kv.allocate("b", 4)
    kv.cache_blocks("a", [7], 4)
    kv.cache_blocks("b", [7], 4)
    assert dict(kv.pool.cached_block_ids()) == {7: 0}
    assert kv.pool.block_hash(1) is None
    kv.check_invariants()


def test_two_requests_share_leading_blocks() -> None:
    kv = make()
    kv.allocate("a", 12, block_hashes=[1, 2, 3])
    kv.cache_blocks("a", [1, 2, 3], 12)
    assert kv.match_prefix([1, 2, 9]) == 2
    grant = kv.allocate("b", 12, block_hashes=[1, 2, 9])
    assert grant == Grant(granted=True, new_block_ids=(0, 1, 3), num_missing_blocks=0, num_cached_blocks=2)
    assert kv.pool.ref_count(0) == kv.pool.ref_count(1) == 2
    assert kv.num_used_blocks == 4
    kv.check_invariants()
    assert kv.free("a") == 3
    assert kv.pool.ref_count(0) == 1 and kv.num_used_blocks == 3  # b still uses the shared blocks
    assert kv.pool.free_block_ids()[-1] == 2  # a's unshared block is free (and stays cached)
    assert kv.match_prefix([1, 2, 3]) == 3
    kv.check_invariants()


def test_cache_hit_only_on_first_allocation() -> None:
    kv = make()
    kv.allocate("a", 8)
    kv.cache_blocks("a", [1, 2], 8)
    kv.allocate("b", 1)
    grant = kv.allocate("b", 8, block_hashes=[1, 2])  # b already holds a block: no lookup
    assert grant.num_cached_blocks == 0 and grant.new_block_ids == (3,)


def test_whole_prompt_cached() -> None:
    kv = make()
    kv.allocate("a", 8, block_hashes=[1, 2])
    kv.cache_blocks("a", [1, 2], 8)
    kv.free("a")
    assert kv.num_free_blocks == 8 and kv.match_prefix([1, 2]) == 2
    grant = kv.allocate("b", 8, block_hashes=[1, 2])
    assert grant == Grant(granted=True, new_block_ids=(0, 1), num_missing_blocks=0, num_cached_blocks=2)
    assert kv.num_free_blocks == 6 and 0 not in kv.pool.free_block_ids()
    grant = kv.allocate("c", 9, block_hashes=[1, 2])  # a cached prompt plus one fresh block
    assert grant.num_cached_blocks == 2 and grant.new_block_ids[:2] == (0, 1) and len(grant.new_block_ids) == 3
    kv.check_invariants()


def test_hits_are_limited_to_the_blocks_needed() -> None:
    kv = make()
    kv.allocate("a", 12)
    kv.cache_blocks("a", [1, 2, 3], 12)
    grant = kv.allocate("b", 5, block_hashes=[1, 2, 3])
    assert grant.num_cached_blocks == 2 and grant.new_block_ids == (0, 1)


def test_free_cached_hits_count_against_free_blocks() -> None:
    kv = make(num_blocks=3, block_size=2)
    kv.allocate("a", 4)
    kv.cache_blocks("a", [1, 2], 4)
    kv.free("a")
    kv.allocate("x", 2)  # takes block 2; free list is now (1, 0), both cached
    grant = kv.allocate("b", 6, block_hashes=[1, 2])  # 2 free hits + 1 fresh, only 2 free
    assert grant == Grant(granted=False, new_block_ids=(), num_missing_blocks=1)
    assert kv.match_prefix([1, 2]) == 2 and "b" not in kv
    kv.check_invariants()


def test_lru_eviction_order_of_cached_free_blocks() -> None:
    kv = make(num_blocks=4, block_size=1)
    for request_id, block_hash in (("a", 1), ("b", 2), ("c", 3)):
        kv.allocate(request_id, 1)
        kv.cache_blocks(request_id, [block_hash], 1)
    for request_id in ("b", "c", "a"):  # released in this order: b's block is least recently freed
        kv.free(request_id)
    assert kv.pool.free_block_ids() == (3, 1, 2, 0)
    assert kv.allocate("d", 1).new_block_ids == (3,)  # the never-cached block first
    assert kv.match_prefix([2]) == 1
    assert kv.allocate("e", 1).new_block_ids == (1,)  # evicts b's hash
    assert kv.match_prefix([2]) == 0 and kv.match_prefix([3]) == 1 and kv.match_prefix([1]) == 1
    kv.allocate("f", 1)  # evicts c's
    assert kv.match_prefix([3]) == 0 and kv.match_prefix([1]) == 1
    kv.check_invariants()


def test_reused_block_leaves_the_middle_of_the_free_list() -> None:
    kv = make(num_blocks=4, block_size=1)
    kv.allocate("a", 3)
    kv.cache_blocks("a", [1, 2, 3], 3)
    kv.free("a")
    assert kv.pool.free_block_ids() == (3, 2, 1, 0)  # released last-block-first
    grant = kv.allocate("b", 1, block_hashes=[1])
    assert grant.new_block_ids == (0,) and grant.num_cached_blocks == 1
    assert kv.pool.free_block_ids() == (3, 2, 1)
    kv.check_invariants()


def test_trim_then_reallocate_consults_the_cache_again() -> None:
    kv = make()
    kv.allocate("a", 8)
    kv.cache_blocks("a", [1, 2], 8)
    assert kv.trim("a", 4) == 1
    assert kv.match_prefix([1, 2]) == 2  # the trimmed block keeps its hash while free
    assert kv.trim("a", 0) == 1
    grant = kv.allocate("a", 8, block_hashes=[1, 2])
    assert grant.num_cached_blocks == 2 and kv.block_table("a") == (0, 1)
    kv.check_invariants()


def test_cache_blocks_after_trim_registers_new_blocks() -> None:
    kv = make(block_size=1)
    kv.allocate("a", 3)
    kv.cache_blocks("a", [1, 2, 3], 3)
    kv.trim("a", 1)
    kv.allocate("a", 3)
    new_ids = kv.block_table("a")[1:]
    kv.cache_blocks("a", [1, 5, 6], 3)
    assert [kv.pool.block_hash(b) for b in new_ids] == [5, 6]
    kv.check_invariants()


def test_cache_blocks_of_swapped_request_raises() -> None:
    kv = KVCacheManager(4, 2, enable_prefix_caching=True, num_host_blocks=4)
    kv.allocate("a", 4)
    kv.swap_out("a")
    with pytest.raises(ValueError, match="swapped out"):
        kv.cache_blocks("a", [1, 2], 4)
