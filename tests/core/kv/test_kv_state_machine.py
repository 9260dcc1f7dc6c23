"""A hypothesis state machine over KVCacheManager: random allocate / cache_blocks / trim / free /
swap_out / swap_in / match_prefix over a few requests whose prompts share hash prefixes.

`check_invariants` runs after every rule; each rule also checks its own answer (grow-only
allocation, all-or-nothing refusals, counts returned). At teardown everything is freed and every
block must be free again.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from contbatch.core.kv import KVCacheManager

REQUEST_IDS = ("r0", "r1", "r2", "r3", "r4")
MAX_BLOCKS_PER_REQUEST = 8
# r0..r2 share the leading blocks of one prompt (diverging after 3, 2, 1 blocks), r3 repeats r0's
# prompt exactly, r4 shares nothing: chained hashes as a real prompt would give them.
SHARED = (101, 102, 103)
HASHES: dict[str, tuple[int, ...]] = {
    "r0": SHARED + tuple(range(1000, 1005)),
    "r1": SHARED[:2] + tuple(range(2000, 2006)),
    "r2": SHARED[:1] + tuple(range(3000, 3007)),
    "r3": SHARED + tuple(range(1000, 1005)),
    "r4": tuple(range(4000, 4008)),
}

request_ids = st.sampled_from(REQUEST_IDS)


def expect_value_error(call: Callable[[], object]) -> None:
    try:
        call()
    except ValueError:
        return
    raise AssertionError("expected ValueError")


def snapshot(kv: KVCacheManager) -> tuple[object, ...]:
    pool = kv.pool
    return (
        {r: (kv.block_table(r), kv.host_block_table(r), r in kv) for r in REQUEST_IDS},
        pool.free_block_ids(),
        dict(pool.cached_block_ids()),
        tuple(pool.ref_count(b) for b in range(kv.num_blocks)),
        kv.num_free_host_blocks,
    )


class KVMachine(RuleBasedStateMachine):
    kv: KVCacheManager

    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.integers(1, 4),
        enable_prefix_caching=st.booleans(),
        num_host_blocks=st.integers(0, 10),
    )
    def setup(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_host_blocks: int) -> None:
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=enable_prefix_caching, num_host_blocks=num_host_blocks
        )
        self.num_tokens: dict[str, int] = {}  # model: tokens each resident request may have computed
        self.contents: dict[int, int] = {}  # model: device block -> hash of the full block of tokens it holds

    def record_computed(self, request_id: str, num_computed_tokens: int) -> None:
        table = self.kv.block_table(request_id)
        num_full = min(num_computed_tokens // self.kv.block_size, len(table))
        for block_id, block_hash in zip(table[:num_full], HASHES[request_id], strict=False):
            self.contents[block_id] = block_hash

    def released_in_vllm_order(self, released_ids: tuple[int, ...], ref_counts: list[int]) -> None:
        """Blocks losing their last holder went back, last block of the table first: those recording
        a hash to the free-list tail, the others to its head (vLLM's order)."""
        pool = self.kv.pool
        freed_ids = tuple(b for b, n in zip(released_ids, ref_counts, strict=True) if n == 1)[::-1]
        cached = tuple(b for b in freed_ids if pool.block_hash(b) is not None)
        uncached = tuple(b for b in freed_ids if pool.block_hash(b) is None)
        free_ids = pool.free_block_ids()
        assert free_ids[: len(uncached)] == uncached
        assert free_ids[len(free_ids) - len(cached) :] == cached

    @invariant()
    def invariants_hold(self) -> None:
        self.kv.check_invariants()

    @invariant()
    def cached_hashes_name_block_contents(self) -> None:
        for block_hash, block_id in self.kv.pool.cached_block_ids().items():
            assert self.contents.get(block_id) == block_hash, f"block {block_id} cached as {block_hash}"

    @rule(
        request_id=request_ids,
        num_blocks=st.integers(0, MAX_BLOCKS_PER_REQUEST),
        extra=st.integers(0, 3),
        compute=st.booleans(),
    )
    def allocate(self, request_id: str, num_blocks: int, extra: int, compute: bool) -> None:
        kv = self.kv
        num_tokens = max(0, num_blocks * kv.block_size - extra)
        if kv.is_swapped(request_id):
            before = snapshot(kv)
            expect_value_error(lambda: kv.allocate(request_id, num_tokens))
            assert snapshot(kv) == before
            return
        held_ids = kv.block_table(request_id)
        first = not held_ids
        num_hits = min(kv.match_prefix(HASHES[request_id]), kv.num_blocks_for(num_tokens)) if first else 0
        num_free, before = kv.num_free_blocks, snapshot(kv)
        grant = kv.allocate(request_id, num_tokens, block_hashes=HASHES[request_id])
        num_new = max(0, kv.num_blocks_for(num_tokens) - len(held_ids))
        if not grant.granted:
            event("allocate: refused")
            assert snapshot(kv) == before
            assert grant.new_block_ids == () and grant.num_missing_blocks >= 1
            # missing == (fresh blocks + free cache hits) - free blocks
            assert num_new - num_hits <= num_free + grant.num_missing_blocks <= num_new
            assert kv.enable_prefix_caching or num_free + grant.num_missing_blocks == num_new
            return
        assert grant.num_missing_blocks == 0 and grant.num_cached_blocks == num_hits
        for block_id, block_hash in zip(grant.new_block_ids[:num_hits], HASHES[request_id], strict=False):
            assert self.contents.get(block_id) == block_hash  # a hit holds exactly that prefix block
        for block_id in grant.new_block_ids[num_hits:]:
            assert kv.pool.block_hash(block_id) is None  # a fresh block was evicted from the cache
            self.contents.pop(block_id, None)
        if num_hits:
            event("allocate: prefix-cache hit")
        if any(kv.pool.ref_count(b) > 1 for b in grant.new_block_ids):
            event("allocate: shares a held block")
        assert kv.block_table(request_id) == held_ids + grant.new_block_ids
        assert len(grant.new_block_ids) == num_new
        assert num_free - num_new <= kv.num_free_blocks <= num_free - (num_new - num_hits)
        if not kv.enable_prefix_caching:
            assert num_new <= num_free
        if first:  # computed tokens survive only as far as the blocks held
            self.num_tokens[request_id] = 0
        self.num_tokens[request_id] = max(self.num_tokens.get(request_id, 0), num_tokens)
        if compute:  # the step ran: all the request's tokens are computed
            self.compute_all(request_id)

    @rule(request_id=request_ids, num_blocks=st.integers(0, MAX_BLOCKS_PER_REQUEST))
    def restart(self, request_id: str, num_blocks: int) -> None:
        """Recompute preemption: free the request, then allocate it again from scratch (a cache lookup)."""
        self.free(request_id)
        self.allocate(request_id, num_blocks, extra=0, compute=True)

    @rule(request_id=request_ids, num_tokens=st.integers(0, MAX_BLOCKS_PER_REQUEST * 4 + 4))
    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        kv = self.kv
        if kv.is_swapped(request_id):
            expect_value_error(lambda: kv.cache_blocks(request_id, HASHES[request_id], num_tokens))
            return
        # Claims the first num_tokens tokens are computed: only as far as the request ever held.
        num_tokens = min(num_tokens, self.num_tokens.get(request_id, 0))
        self.record_computed(request_id, num_tokens)
        kv.cache_blocks(request_id, HASHES[request_id], num_tokens)
        after = dict(kv.pool.cached_block_ids())
        kv.cache_blocks(request_id, HASHES[request_id], num_tokens)
        assert dict(kv.pool.cached_block_ids()) == after  # idempotent
        table = kv.block_table(request_id)
        num_full = min(num_tokens // kv.block_size, len(table))
        for block_id, block_hash in zip(table[:num_full], HASHES[request_id], strict=False):
            # None: the hash was cached by another block when this one was offered (the first keeps it).
            assert kv.pool.block_hash(block_id) in (None, block_hash)

    @rule(request_id=request_ids)
    def compute_all(self, request_id: str) -> None:
        """The common case: every allocated token is computed, so its full blocks get cached."""
        if request_id in self.kv and not self.kv.is_swapped(request_id):
            self.record_computed(request_id, self.num_tokens.get(request_id, 0))
            self.kv.cache_blocks(request_id, HASHES[request_id], self.num_tokens.get(request_id, 0))

    @rule(request_id=request_ids, num_tokens=st.integers(0, MAX_BLOCKS_PER_REQUEST * 4))
    def trim(self, request_id: str, num_tokens: int) -> None:
        kv = self.kv
        if kv.is_swapped(request_id):
            expect_value_error(lambda: kv.trim(request_id, num_tokens))
            return
        held_ids = kv.block_table(request_id)
        num_keep = kv.num_blocks_for(num_tokens)
        ref_counts = [kv.pool.ref_count(b) for b in held_ids[num_keep:]]
        assert kv.trim(request_id, num_tokens) == max(0, len(held_ids) - num_keep)
        self.released_in_vllm_order(held_ids[num_keep:], ref_counts)
        if request_id in self.num_tokens:
            self.num_tokens[request_id] = min(self.num_tokens[request_id], num_tokens)
        assert kv.block_table(request_id) == held_ids[:num_keep]

    @rule(request_id=request_ids)
    def free(self, request_id: str) -> None:
        kv = self.kv
        num_held, num_free = kv.num_held_blocks(request_id), kv.num_free_host_blocks
        num_host_held = kv.num_held_host_blocks(request_id)
        held_ids = kv.block_table(request_id)
        ref_counts = [kv.pool.ref_count(b) for b in held_ids]
        assert kv.free(request_id) == num_held
        self.released_in_vllm_order(held_ids, ref_counts)
        assert request_id not in kv and kv.num_free_host_blocks == num_free + num_host_held
        self.num_tokens.pop(request_id, None)

    def pick(self, request_id: str, index: int, eligible: Callable[[str], bool]) -> str:
        """`request_id`, or (when index >= 0) an eligible request if there is one: fewer wasted steps."""
        candidate_ids = [r for r in REQUEST_IDS if eligible(r)]
        return candidate_ids[index % len(candidate_ids)] if index >= 0 and candidate_ids else request_id

    @rule(request_id=request_ids, index=st.integers(-1, 4))
    def swap_out(self, request_id: str, index: int) -> None:
        kv = self.kv
        request_id = self.pick(request_id, index, lambda r: r in kv and not kv.is_swapped(r))
        held_ids, num_free_host, before = kv.block_table(request_id), kv.num_free_host_blocks, snapshot(kv)
        if request_id not in kv or kv.is_swapped(request_id):
            expect_value_error(lambda: kv.swap_out(request_id))
            assert snapshot(kv) == before
            return
        ref_counts = [kv.pool.ref_count(b) for b in held_ids]
        out = kv.swap_out(request_id)
        if len(held_ids) > num_free_host:
            assert not out.swapped and out.device_block_ids == () and snapshot(kv) == before
            return
        event("swap_out: swapped")
        assert out.swapped and out.device_block_ids == held_ids and out.num_host_blocks == len(held_ids)
        assert kv.is_swapped(request_id) and kv.num_held_host_blocks(request_id) == len(held_ids)
        assert kv.num_held_blocks(request_id) == 0
        self.released_in_vllm_order(held_ids, ref_counts)
        self.num_tokens[request_id] = min(self.num_tokens.get(request_id, 0), len(held_ids) * kv.block_size)

    @rule(request_id=request_ids, index=st.integers(-1, 4))
    def swap_in(self, request_id: str, index: int) -> None:
        kv = self.kv
        request_id = self.pick(request_id, index, kv.is_swapped)
        num_host_held, num_free, before = kv.num_held_host_blocks(request_id), kv.num_free_blocks, snapshot(kv)
        if not kv.is_swapped(request_id):
            expect_value_error(lambda: kv.swap_in(request_id))
            assert snapshot(kv) == before
            return
        grant = kv.swap_in(request_id)
        if num_host_held > num_free:
            assert not grant.granted and grant.num_missing_blocks == num_host_held - num_free
            assert snapshot(kv) == before
            return
        event("swap_in: granted")
        assert grant.granted and len(grant.new_block_ids) == num_host_held and grant.num_cached_blocks == 0
        assert kv.block_table(request_id) == grant.new_block_ids and not kv.is_swapped(request_id)
        for block_id in grant.new_block_ids:
            assert kv.pool.block_hash(block_id) is None
            self.contents.pop(block_id, None)

    @rule(request_id=request_ids)
    def invalid_calls_change_nothing(self, request_id: str) -> None:
        kv = self.kv
        before = snapshot(kv)
        expect_value_error(lambda: kv.allocate(request_id, -1))
        expect_value_error(lambda: kv.trim(request_id, -1))
        expect_value_error(lambda: kv.cache_blocks(request_id, HASHES[request_id], -1))
        assert kv.match_prefix(HASHES[request_id]) <= len(HASHES[request_id])
        assert snapshot(kv) == before

    def teardown(self) -> None:
        kv = getattr(self, "kv", None)
        if kv is None:
            return
        for request_id in REQUEST_IDS:
            kv.free(request_id)
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks and kv.num_used_blocks == 0
        assert kv.num_free_host_blocks == kv.num_host_blocks


KVMachine.TestCase.settings = settings(
    max_examples=5 * settings().max_examples,
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_state_machine = KVMachine.TestCase
