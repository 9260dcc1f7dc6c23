"""`BlockPool` against a reference model: the plain one-block-at-a-time pool (an OrderedDict free
list, vLLM's release order), call for call.

A hypothesis state machine takes, shares (free blocks out of the middle of the free list too),
releases (in bulk, repeats and invalid releases included), caches and matches on both, with the
compaction thresholds of the free list's storage drawn small, and compares everything observable
after every call: answers, errors, the free list in order, ref counts, the prefix cache in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from unittest import mock

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from contbatch.core.kv import BlockPool
from contbatch.core.kv import pool as pool_module
from contbatch.core.kv.invariants import check_pool


class ReferencePool:
    """The pool's observable behaviour, one block at a time (the code before the bulk layout)."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_of_block: dict[int, int] = {}
        self.block_of_hash: dict[int, int] = {}

    def take(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free):
            raise ValueError("too many")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _none = self.free.popitem(last=False)
            self.ref_counts[block_id] = 1
            block_hash = self.hash_of_block.pop(block_id, None)
            if block_hash is not None:
                del self.block_of_hash[block_hash]
            block_ids.append(block_id)
        return block_ids

    def share(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """vLLM's order: freed blocks with a hash to the tail; without, to the head, first first."""
        to_head = []
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if block_id in self.hash_of_block:
                    self.free[block_id] = None
                else:
                    to_head.append(block_id)
        for block_id in reversed(to_head):
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: int) -> bool:
        if block_id in self.hash_of_block or block_hash in self.block_of_hash:
            return False
        self.hash_of_block[block_id] = block_hash
        self.block_of_hash[block_hash] = block_id
        return True

    def match(self, block_hashes: Sequence[int], limit: int) -> list[int]:
        hit_ids: list[int] = []
        for block_hash in block_hashes:
            if len(hit_ids) >= limit:
                break
            block_id = self.block_of_hash.get(block_hash)
            if block_id is None or block_id in hit_ids:
                break
            hit_ids.append(block_id)
        return hit_ids


def releasable(ref_counts: list[int], block_ids: Sequence[int]) -> bool:
    remaining = dict(enumerate(ref_counts))
    for block_id in block_ids:
        if remaining[block_id] == 0:
            return False
        remaining[block_id] -= 1
    return True


def observe(pool: BlockPool) -> tuple[object, ...]:
    return (
        pool.free_block_ids(),
        tuple(pool.ref_count(b) for b in range(pool.num_blocks)),
        tuple(pool.cached_block_ids().items()),
        tuple(pool.block_hash(b) for b in range(pool.num_blocks)),
        pool.num_free_blocks,
        pool.num_used_blocks,
        pool.num_cached_blocks,
    )


def expect(error: type[Exception], call: Callable[[], object]) -> None:
    try:
        call()
    except error:
        return
    raise AssertionError(f"expected {error.__name__}")


class PoolMachine(RuleBasedStateMachine):
    pool: BlockPool

    @initialize(num_blocks=st.integers(0, 12), min_compact=st.sampled_from([0, 1, 2, 64]))
    def setup(self, num_blocks: int, min_compact: int) -> None:
        self.patch = mock.patch.object(pool_module, "_MIN_COMPACT", min_compact)
        self.patch.start()
        self.pool = BlockPool(num_blocks, 1, enable_prefix_caching=True)
        self.ref = ReferencePool(num_blocks)
        self.tables: dict[int, list[int]] = {}  # holders, for check_pool: one table per holding

    def teardown(self) -> None:
        patch = getattr(self, "patch", None)
        if patch is not None:
            patch.stop()

    def holder_tables(self) -> dict[str, list[int]]:
        tables: dict[str, list[int]] = {}
        for block_id, n in enumerate(self.ref.ref_counts):
            for i in range(n):
                tables.setdefault(f"h{i}", []).append(block_id)
        return tables

    @invariant()
    def same_as_reference(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool, ref = self.pool, self.ref
        assert pool.free_block_ids() == tuple(ref.free)
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == ref.ref_counts
        assert list(pool.cached_block_ids().items()) == list(ref.block_of_hash.items())
        assert pool.num_free_blocks == len(ref.free) and pool.num_cached_blocks == len(ref.hash_of_block)
        check_pool(pool, self.holder_tables(), "device")

    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        num_blocks = data.draw(st.integers(0, self.pool.num_free_blocks + 1))
        if num_blocks > self.pool.num_free_blocks:
            before = observe(self.pool)
            expect(ValueError, lambda: self.pool.take(num_blocks))
            assert observe(self.pool) == before
            return
        assert self.pool.take(num_blocks) == self.ref.take(num_blocks)

    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        if not self.pool.num_blocks:
            return
        block_ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=3))
        if any(self.ref.ref_counts[b] == 0 for b in block_ids):
            event("share: a free block")
        self.pool.share_all(block_ids)
        for block_id in block_ids:
            self.ref.share(block_id)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = [b for b, n in enumerate(self.ref.ref_counts) for _ in range(n)]
        block_ids = data.draw(st.lists(st.sampled_from(held), unique=False, max_size=6)) if held else []
        if self.pool.num_blocks and data.draw(st.booleans()):  # any block: sometimes one release too many
            block_ids.append(data.draw(st.integers(0, self.pool.num_blocks - 1)))
        block_ids = data.draw(st.permutations(block_ids))
        if not releasable(self.ref.ref_counts, block_ids):
            event("release: invalid")
            before = observe(self.pool)
            expect(ValueError, lambda: self.pool.release(block_ids))
            assert observe(self.pool) == before  # all-or-nothing
            return
        self.pool.release(iter(block_ids) if data.draw(st.booleans()) else block_ids)
        self.ref.release(block_ids)

    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        held = [b for b, n in enumerate(self.ref.ref_counts) if n]
        if not held:
            return
        pairs = data.draw(st.lists(st.tuples(st.sampled_from(held), st.integers(0, 15)), max_size=4))
        block_ids = [b for b, _ in pairs]
        block_hashes = [h for _, h in pairs]
        if len(pairs) == 1:
            assert self.pool.cache(block_ids[0], block_hashes[0]) == self.ref.cache(block_ids[0], block_hashes[0])
            return
        expected = sum(self.ref.cache(b, h) for b, h in pairs)
        assert self.pool.cache_all(block_ids, block_hashes) == expected

    @rule(hashes=st.lists(st.integers(0, 15), max_size=6), limit=st.integers(-1, 7))
    def match(self, hashes: list[int], limit: int) -> None:
        assert self.pool.match(hashes, limit) == self.ref.match(hashes, limit)

    @rule(data=st.data())
    def count_free(self, data: st.DataObject) -> None:
        if not self.pool.num_blocks:
            return
        block_ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=5))
        assert self.pool.count_free(block_ids) == sum(1 for b in block_ids if self.ref.ref_counts[b] == 0)


PoolMachine.TestCase.settings = settings(
    max_examples=4 * settings().max_examples,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_matches_reference = PoolMachine.TestCase


def test_cache_all_checks_every_block_first() -> None:
    pool = BlockPool(3, 1, enable_prefix_caching=True)
    a, b = pool.take(2)
    pool.release([b])
    expect(ValueError, lambda: pool.cache_all([a, b], [1, 2]))
    assert pool.num_cached_blocks == 0  # nothing recorded: b is free
    assert pool.cache_all([a, a], [1, 2]) == 1 and pool.block_hash(a) == 1
    expect(ValueError, lambda: BlockPool(2, 1).cache_all([], []))


def test_many_stale_entries_are_dropped() -> None:
    """Cached blocks shared out of the free list and released again leave stale entries; a rebuild
    keeps the list short without changing the free list's order."""
    pool = BlockPool(100, 1, enable_prefix_caching=True)
    pool.take(100)
    assert pool.cache_all(list(range(100)), list(range(1000, 1100))) == 100
    pool.release(list(range(100)))  # all cached: to the tail in order
    for _ in range(50):
        pool.share_all(range(99, -1, -1))  # every block: out of the middle, back to the tail
        pool.release(list(range(100)))
    assert pool.free_block_ids() == tuple(range(100))
    assert not pool.layout_errors()
    assert len(pool._free) <= 300  # bounded: not 5,000 entries
    assert pool.take(3) == [0, 1, 2]


def test_release_order_is_vllms() -> None:
    """Freed blocks without a hash go to the head, the first released first; cached ones to the tail."""
    pool = BlockPool(6, 1, enable_prefix_caching=True)
    a, b, c, d = pool.take(4)  # free: 4 5
    pool.cache(b, 7)
    pool.release([d, c, b, a])  # d, c, a to the head in that order; b (cached) to the tail
    assert pool.free_block_ids() == (d, c, a, 4, 5, b)
    assert pool.take(4) == [d, c, a, 4]
    pool.share(b)  # a prefix hit takes the cached block out of the list
    assert pool.free_block_ids() == (5,)
