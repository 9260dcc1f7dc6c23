"""KVCacheManager without prefix caching: sizes, allocate (all-or-nothing, grow only), trim, free."""

from __future__ import annotations

import pytest

from contbatch.core.kv import Grant, KVCacheManager, KVInvariantError


def test_constructor_validates_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVCacheManager(0, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_host_blocks must be >= 0"):
        KVCacheManager(4, 4, num_host_blocks=-1)
    kv = KVCacheManager(8, 4, num_host_blocks=2)
    assert (kv.num_blocks, kv.block_size, kv.num_host_blocks) == (8, 4, 2)
    assert kv.num_free_blocks == 8 and kv.num_used_blocks == 0 and kv.usage == 0.0
    assert kv.num_free_host_blocks == 2
    kv.check_invariants()


def test_num_blocks_for_rounds_up() -> None:
    kv = KVCacheManager(8, 4)
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        kv.num_blocks_for(-1)


def test_allocate_grows_and_reports_new_blocks() -> None:
    kv = KVCacheManager(8, 4)
    grant = kv.allocate("a", 5)
    assert grant == Grant(granted=True, new_block_ids=(0, 1), num_missing_blocks=0, num_cached_blocks=0)
    assert kv.block_table("a") == (0, 1) and kv.num_held_blocks("a") == 2
    assert kv.num_used_blocks == 2 and kv.num_free_blocks == 6 and kv.usage == 0.25
    assert kv.allocate("a", 8) == Grant(True, (), 0)  # already holds enough
    assert kv.allocate("a", 3) == Grant(True, (), 0)  # never shrinks
    assert kv.block_table("a") == (0, 1)
    assert kv.allocate("a", 9).new_block_ids == (2,)
    assert kv.block_table("a") == (0, 1, 2)
    kv.check_invariants()


def test_hot_path_returns_a_shared_grant() -> None:
    kv = KVCacheManager(8, 4)
    kv.allocate("a", 8)
    assert kv.allocate("a", 7) is kv.allocate("a", 8)


def test_allocate_is_all_or_nothing() -> None:
    kv = KVCacheManager(4, 2)
    kv.allocate("a", 5)  # 3 blocks
    grant = kv.allocate("b", 6)  # needs 3, 1 free
    assert grant == Grant(granted=False, new_block_ids=(), num_missing_blocks=2)
    assert "b" not in kv and kv.num_free_blocks == 1
    grant = kv.allocate("a", 10)  # needs 2 more
    assert not grant.granted and grant.num_missing_blocks == 1
    assert kv.block_table("a") == (0, 1, 2)
    kv.check_invariants()


def test_allocate_zero_tokens_registers_the_request() -> None:
    kv = KVCacheManager(4, 2)
    assert kv.allocate("a", 0) == Grant(True, (), 0)
    assert "a" in kv and kv.block_table("a") == () and kv.num_held_blocks("a") == 0


def test_allocate_rejects_negative_tokens() -> None:
    kv = KVCacheManager(4, 2)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        kv.allocate("a", -1)
    assert "a" not in kv


def test_unknown_request_views() -> None:
    kv = KVCacheManager(4, 2)
    assert kv.num_held_blocks("x") == 0
    assert kv.block_table("x") == ()
    assert kv.host_block_table("x") == ()
    assert kv.num_held_host_blocks("x") == 0
    assert kv.blocks_needed("x", 3) == 2
    assert not kv.is_swapped("x")
    assert "x" not in kv
    assert kv.free("x") == 0
    assert kv.trim("x", 0) == 0


def test_blocks_needed() -> None:
    kv = KVCacheManager(8, 4)
    kv.allocate("a", 6)
    assert kv.blocks_needed("a", 0) == 0
    assert kv.blocks_needed("a", 8) == 0
    assert kv.blocks_needed("a", 9) == 1
    assert kv.blocks_needed("a", 17) == 3
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        kv.blocks_needed("a", -3)


def test_trim_releases_tail_blocks() -> None:
    kv = KVCacheManager(8, 2)
    kv.allocate("a", 8)  # blocks 0..3
    assert kv.trim("a", 8) == 0
    assert kv.trim("a", 3) == 2
    assert kv.block_table("a") == (0, 1)
    assert kv.pool.free_block_ids()[:2] == (3, 2)  # released last-block-first, to the head (no hash)
    assert kv.trim("a", 0) == 2
    assert kv.block_table("a") == () and "a" in kv
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        kv.trim("a", -1)
    kv.check_invariants()


def test_free_releases_everything_last_block_first() -> None:
    kv = KVCacheManager(6, 2)
    kv.allocate("a", 6)  # 0, 1, 2
    kv.allocate("b", 2)  # 3
    assert kv.free("a") == 3
    assert "a" not in kv and kv.block_table("a") == ()
    assert kv.pool.free_block_ids() == (2, 1, 0, 4, 5)
    assert kv.free("a") == 0
    assert kv.free("b") == 1
    assert kv.num_free_blocks == 6
    kv.check_invariants()


def test_without_prefix_caching_hashes_are_ignored() -> None:
    kv = KVCacheManager(8, 2)
    kv.allocate("a", 4, block_hashes=[1, 2])
    kv.cache_blocks("a", [1, 2], 4)
    assert kv.match_prefix([1, 2]) == 0
    grant = kv.allocate("b", 4, block_hashes=[1, 2])
    assert grant.num_cached_blocks == 0 and grant.new_block_ids == (2, 3)
    with pytest.raises(ValueError, match="num_computed_tokens must be >= 0"):
        kv.cache_blocks("a", [1], -1)


def test_check_invariants_detects_corruption() -> None:
    kv = KVCacheManager(4, 2)
    kv.allocate("a", 4)
    kv._tables["a"].append(0)  # a block twice in one table
    with pytest.raises(KVInvariantError, match="holds a block twice"):
        kv.check_invariants()
    kv = KVCacheManager(4, 2)
    kv.allocate("a", 4)
    kv.pool.take(1)  # a block held by no table
    with pytest.raises(KVInvariantError, match="ref count 1 but 0 tables"):
        kv.check_invariants()
