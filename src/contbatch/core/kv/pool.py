"""`BlockPool`: fixed-size KV blocks with reference counts, an LRU free list and a prefix-hash map.

The pool owns block ids `0 .. num_blocks - 1`. Who holds a block is the caller's business (the
`KVCacheManager` keeps the per-request tables); the pool only counts holders.

Invariants (checked by `contbatch.core.kv.invariants.check_pool`):
- `ref_count(b) >= 0` for every block; the free list holds exactly the blocks with ref count 0,
  each once, in order of release (head = released longest ago, taken first);
- `num_free_blocks + num_used_blocks == num_blocks`;
- the hash map is a bijection between cached hashes and the blocks that record them: a hash maps
  to one block, and that block's recorded hash is that hash. A block keeps its hash while it is
  free (a later request may reuse it) until `take` hands it out again, which drops the hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType


class BlockPool:
    """num_blocks blocks of block_size token slots, with reference counts and a free list.

    Free blocks are kept in LRU order of release (a released block goes to the tail, allocation
    takes from the head). With prefix caching a free block may still hold a cached hash: it stays
    reusable until it is evicted by being allocated to someone else (its hash is dropped then).
    """

    __slots__ = (
        "_block_of_hash",
        "_free",
        "_hash_of_block",
        "_ref_counts",
        "block_size",
        "enable_prefix_caching",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Keyed by block id so a cached free block can leave the middle of the list in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}

    # -- read-only views ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached-but-free ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks recording a prefix hash, held or free."""
        return len(self._hash_of_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The hash the block records, or None when it records none (not an error)."""
        return self._hash_of_block.get(block_id)

    def free_block_ids(self) -> tuple[int, ...]:
        """The free list, head (next to be taken) first."""
        return tuple(self._free)

    def cached_block_ids(self) -> Mapping[int, int]:
        """A read-only view of the prefix cache: hash -> block id."""
        return MappingProxyType(self._block_of_hash)

    def match(self, block_hashes: Sequence[int], limit: int) -> list[int]:
        """The blocks caching the leading `block_hashes`, at most `limit`, stopping at the first miss.

        A hash repeated within the prefix stops the match too, so the result never names a block
        twice. Read-only.
        """
        block_of_hash = self._block_of_hash
        hit_ids: list[int] = []
        if not block_of_hash:
            return hit_ids
        seen: set[int] = set()
        for block_hash in block_hashes:
            if len(hit_ids) >= limit:
                break
            block_id = block_of_hash.get(block_hash)
            if block_id is None or block_id in seen:
                break
            seen.add(block_id)
            hit_ids.append(block_id)
        return hit_ids

    # -- mutations ---------------------------------------------------------------------------

    def take(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the free-list head, each with ref count 1 and no hash.

        The caller checks `num_free_blocks` first; asking for more is a bug (ValueError).
        """
        free = self._free
        if num_blocks > len(free):
            raise ValueError(f"cannot take {num_blocks} blocks: only {len(free)} are free")
        ref_counts = self._ref_counts
        hash_of_block = self._hash_of_block
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id, _none = free.popitem(last=False)
            ref_counts[block_id] = 1
            if hash_of_block:
                self._evict(block_id)
            block_ids.append(block_id)
        return block_ids

    def share(self, block_id: int) -> None:
        """Add a holder to `block_id` (a prefix-cache hit); a free block leaves the free list."""
        ref_count = self._ref_counts[block_id]
        if ref_count == 0:
            del self._free[block_id]
        self._ref_counts[block_id] = ref_count + 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block, in order; a block reaching 0 goes to the free-list tail.

        Its cached hash, if any, stays until the block is taken again.
        """
        ref_counts = self._ref_counts
        free = self._free
        for block_id in block_ids:
            ref_count = ref_counts[block_id]
            if ref_count <= 0:
                raise ValueError(f"block {block_id} released but it has no holder")
            ref_counts[block_id] = ref_count - 1
            if ref_count == 1:
                free[block_id] = None

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Record that held `block_id` is full and its contents hash to `block_hash`.

        Returns False (and changes nothing) when the block already records a hash or the hash
        is already cached by another block: the first block keeps it, so there are no duplicates.
        """
        if not self.enable_prefix_caching:
            raise ValueError("prefix caching is disabled for this pool")
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: only a held block can be cached")
        if block_id in self._hash_of_block or block_hash in self._block_of_hash:
            return False
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
