"""Swap out / swap in with a bounded host pool."""

from __future__ import annotations

import pytest

from contbatch.core.kv import Grant, KVCacheManager, SwapOut


def test_swap_out_and_in_round_trip() -> None:
    kv = KVCacheManager(6, 2, num_host_blocks=4)
    kv.allocate("a", 5)  # 0, 1, 2
    out = kv.swap_out("a")
    assert out == SwapOut(swapped=True, device_block_ids=(0, 1, 2), num_host_blocks=3)
    assert kv.is_swapped("a") and "a" in kv
    assert kv.num_held_blocks("a") == 0 and kv.block_table("a") == ()
    assert kv.num_held_host_blocks("a") == 3 and kv.host_block_table("a") == (0, 1, 2)
    assert kv.num_free_blocks == 6 and kv.num_free_host_blocks == 1
    kv.check_invariants()
    kv.allocate("b", 2)  # takes block 2 (head of the free list: a's last block, released first)
    grant = kv.swap_in("a")
    assert grant == Grant(granted=True, new_block_ids=(1, 0, 3), num_missing_blocks=0)
    assert not kv.is_swapped("a") and kv.block_table("a") == (1, 0, 3)
    assert kv.num_free_host_blocks == 4 and kv.host_block_table("a") == ()
    kv.check_invariants()


def test_swap_out_refused_when_host_pool_too_small() -> None:
    kv = KVCacheManager(6, 2, num_host_blocks=2)
    kv.allocate("a", 6)  # 3 blocks
    assert kv.swap_out("a") == SwapOut(swapped=False, device_block_ids=(), num_host_blocks=0)
    assert kv.block_table("a") == (0, 1, 2) and not kv.is_swapped("a")
    assert kv.num_free_host_blocks == 2
    kv.allocate("b", 4)
    assert kv.swap_out("b").swapped
    kv.allocate("c", 1)
    assert not kv.swap_out("c").swapped  # host pool full now
    kv.check_invariants()


def test_no_host_pool_swaps_only_empty_tables() -> None:
    kv = KVCacheManager(4, 2)
    kv.allocate("a", 1)
    assert not kv.swap_out("a").swapped
    kv.allocate("e", 0)
    assert kv.swap_out("e") == SwapOut(swapped=True, device_block_ids=(), num_host_blocks=0)
    assert kv.swap_in("e") == Grant(True, (), 0)


def test_swap_in_is_all_or_nothing() -> None:
    kv = KVCacheManager(4, 2, num_host_blocks=4)
    kv.allocate("a", 6)  # 3 blocks
    kv.swap_out("a")
    kv.allocate("b", 4)  # 2 blocks, 2 free
    assert kv.swap_in("a") == Grant(granted=False, new_block_ids=(), num_missing_blocks=1)
    assert kv.is_swapped("a") and kv.num_held_host_blocks("a") == 3 and kv.num_free_blocks == 2
    kv.free("b")
    assert kv.swap_in("a").granted
    kv.check_invariants()


def test_swap_keeps_cached_hashes_and_skips_the_cache_on_swap_in() -> None:
    kv = KVCacheManager(4, 2, enable_prefix_caching=True, num_host_blocks=4)
    kv.allocate("a", 4)
    kv.cache_blocks("a", [1, 2], 4)
    kv.swap_out("a")
    assert kv.match_prefix([1, 2]) == 2  # released device blocks stay cached
    grant = kv.swap_in("a")
    assert grant.num_cached_blocks == 0 and grant.new_block_ids == (2, 3)  # fresh blocks from the head
    assert kv.match_prefix([1, 2]) == 2
    kv.check_invariants()


def test_invalid_swap_calls_raise() -> None:
    kv = KVCacheManager(4, 2, num_host_blocks=4)
    with pytest.raises(ValueError, match="unknown request"):
        kv.swap_out("x")
    with pytest.raises(ValueError, match="not swapped out"):
        kv.swap_in("x")
    kv.allocate("a", 2)
    with pytest.raises(ValueError, match="not swapped out"):
        kv.swap_in("a")
    kv.swap_out("a")
    with pytest.raises(ValueError, match="swapped out"):
        kv.swap_out("a")
    with pytest.raises(ValueError, match="swap_in before allocate"):
        kv.allocate("a", 4)
    with pytest.raises(ValueError, match="swapped out"):
        kv.trim("a", 0)
    kv.check_invariants()


def test_free_of_swapped_request_releases_host_blocks() -> None:
    kv = KVCacheManager(4, 2, num_host_blocks=4)
    kv.allocate("a", 4)
    kv.swap_out("a")
    assert kv.free("a") == 0  # no device blocks
    assert kv.num_free_host_blocks == 4 and "a" not in kv
    kv.check_invariants()
