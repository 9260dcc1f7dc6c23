"""`BlockPool`: fixed-size KV blocks with reference counts, an LRU free list and a prefix-hash map.

The pool owns block ids `0 .. num_blocks - 1`. Who holds a block is the caller's business (the
`KVCacheManager` keeps the per-request tables); the pool only counts holders.

Invariants (checked by `contbatch.core.kv.invariants.check_pool`):
- `ref_count(b) >= 0` for every block; the free list holds exactly the blocks with ref count 0,
  each once, head (taken first) to tail;
- `num_free_blocks + num_used_blocks == num_blocks`;
- the hash map is a bijection between cached hashes and the blocks that record them: a hash maps
  to one block, and that block's recorded hash is that hash. A block keeps its hash while it is
  free (a later request may reuse it) until `take` hands it out again, which drops the hash.

The free list's order is vLLM's (v1 `BlockPool.free_blocks`): a released block that records no
hash can never be a prefix hit, so it goes to the head, to be reused first (the blocks of one
release in the order given, the first at the very head); a block that records a hash goes to the
tail, so cached blocks are evicted least recently released first. With the same requests and the
same releases, the same blocks are evicted, and the prefix hits (hence the decisions) match vLLM's.

How the free list is stored (`layout_errors` checks it): the head part, blocks without a hash
released since, is a stack `_fresh` (its last entry is the head); the rest is a Python list `_free` read from index
`_head`, so taking k blocks is one slice and releasing k blocks one `extend`. A free block that
a prefix-cache hit takes out of the middle (`share`) is not removed from the list: its entry goes
stale, counted in `_stale` (block id -> stale entries of it at or after `_head`; `_num_stale`
their total). A block's entries lie in order of its releases, and only its newest entry can be
live, so reading from the head, an entry of a block with stale entries is the oldest of them and
is skipped. The consumed prefix is dropped once it is at least as long as the rest, and the list
is rebuilt without stale entries once they outnumber the free blocks (both amortised O(1)).
So `len(_free) - _head == num_free_blocks + _num_stale`, and the live entries of `_free[_head:]`
in order are the free list. Ref counts and recorded hashes are lists indexed by block id, so a
block without a hash costs no dict operation anywhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import islice, takewhile
from operator import is_not
from types import MappingProxyType
from typing import cast

_is_not_none = partial(is_not, None)
_MIN_COMPACT = 64  # consumed entries (or stale ones) tolerated before the list is compacted


class BlockPool:
    """num_blocks blocks of block_size token slots, with reference counts and a free list.

    Allocation takes from the free list's head. A released block recording a hash goes to the
    tail (LRU eviction of cached blocks); one recording none goes to the head (reused first). With
    prefix caching a free block may still hold a cached hash: it stays reusable until it is evicted
    by being allocated to someone else (its hash is dropped then).
    """

    __slots__ = (
        "_block_of_hash",
        "_free",
        "_fresh",
        "_hash_of_block",
        "_head",
        "_num_stale",
        "_ref_counts",
        "_stale",
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
        self._free: list[int] = list(range(num_blocks))  # the free list is the live part of _free[_head:]
        self._head = 0
        self._fresh: list[int] = []  # free blocks without a hash released since; the last is the head
        self._stale: dict[int, int] = {}  # block id -> its stale entries in _free[_head:]
        self._num_stale = 0
        self._hash_of_block: list[int | None] = [None] * num_blocks  # the hash each block records
        self._block_of_hash: dict[int, int] = {}

    # -- read-only views ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached-but-free ones included."""
        return len(self._free) - self._head - self._num_stale + len(self._fresh)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks recording a prefix hash, held or free."""
        return len(self._block_of_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def count_free(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` have ref count 0."""
        return list(map(self._ref_counts.__getitem__, block_ids)).count(0)

    def block_hash(self, block_id: int) -> int | None:
        """The hash the block records, or None when it records none (not an error)."""
        return self._hash_of_block[block_id] if 0 <= block_id < self.num_blocks else None

    def free_block_ids(self) -> tuple[int, ...]:
        """The free list, head (next to be taken) first."""
        queued = self._free[self._head :] if not self._num_stale else self._live_entries()
        return (*reversed(self._fresh), *queued)

    def cached_block_ids(self) -> Mapping[int, int]:
        """A read-only view of the prefix cache: hash -> block id."""
        return MappingProxyType(self._block_of_hash)

    def match(self, block_hashes: Sequence[int], limit: int) -> list[int]:
        """The blocks caching the leading `block_hashes`, at most `limit`, stopping at the first miss.

        A hash repeated within the prefix stops the match too, so the result never names a block
        twice. Read-only.
        """
        block_of_hash = self._block_of_hash
        if not block_of_hash or limit <= 0:
            return []
        hits = takewhile(_is_not_none, map(block_of_hash.get, islice(block_hashes, limit)))
        hit_ids = list(cast("Iterator[int]", hits))  # (takewhile stops at the first None)
        if len(set(hit_ids)) < len(hit_ids):  # a repeat: cut at its second occurrence
            seen: set[int] = set()
            for i, block_id in enumerate(hit_ids):
                if block_id in seen:
                    del hit_ids[i:]
                    break
                seen.add(block_id)
        return hit_ids

    # -- mutations ---------------------------------------------------------------------------

    def take(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the free-list head, each with ref count 1 and no hash.

        The caller checks `num_free_blocks` first; asking for more is a bug (ValueError).
        """
        fresh = self._fresh
        if num_blocks == 1 and fresh:  # the commonest case: a decode growing into its next block
            block_id = fresh.pop()
            self._ref_counts[block_id] = 1
            return [block_id]
        if num_blocks > len(fresh):  # (else every block comes from `_fresh`: enough are free)
            num_free = self.num_free_blocks
            if num_blocks > num_free:
                raise ValueError(f"cannot take {num_blocks} blocks: only {num_free} are free")
            if not fresh:
                return self._take_queued(num_blocks)
        if num_blocks <= 0:
            return []
        num_fresh = min(num_blocks, len(fresh))
        block_ids = fresh[-num_fresh:]
        block_ids.reverse()
        del fresh[-num_fresh:]
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        if num_fresh < num_blocks:
            block_ids += self._take_queued(num_blocks - num_fresh)
        return block_ids

    def _take_queued(self, num_blocks: int) -> list[int]:
        """`take` from `_free` (the caller checked there are enough live entries)."""
        free = self._free
        head = self._head
        end = head + num_blocks
        block_ids = free[head:end]
        if self._num_stale and not self._stale.keys().isdisjoint(block_ids):
            block_ids, end = self._take_past_stale(num_blocks)
        self._head = end
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        if self._block_of_hash:
            self._drop_hashes(block_ids)
        if end >= _MIN_COMPACT and end >= len(free) - end:  # drop the consumed prefix: amortised O(1)
            del free[:end]
            self._head = 0
        return block_ids

    def share(self, block_id: int) -> None:
        """Add a holder to `block_id` (a prefix-cache hit); a free block leaves the free list."""
        self.share_all((block_id,))

    def share_all(self, block_ids: Iterable[int]) -> None:
        """`share` each of `block_ids`, in order."""
        ref_counts = self._ref_counts
        stale = self._stale
        for block_id in block_ids:
            ref_count = ref_counts[block_id]
            if ref_count == 0 and not self._leave_fresh(block_id):  # its entry in `_free` goes stale
                stale[block_id] = stale.get(block_id, 0) + 1
                self._num_stale += 1
            ref_counts[block_id] = ref_count + 1
        if self._num_stale > _MIN_COMPACT and self._num_stale > self.num_free_blocks:
            self._drop_stale()

    def _leave_fresh(self, block_id: int) -> bool:
        """Take free `block_id` off `_fresh` if it is there (O(len(_fresh)); prefix hits, the only
        shares of free blocks, name blocks with a hash, which are never there)."""
        if self._hash_of_block[block_id] is not None or block_id not in self._fresh:
            return False
        self._fresh.remove(block_id)
        return True

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block, in order; a block reaching 0 goes back to the free list:
        to the tail when it records a hash (kept until the block is taken again), else to the head
        (the first of `block_ids` freed ends up at the very head). All-or-nothing: a block
        released more often than it is held raises ValueError and changes nothing.
        """
        ids: list[int] = block_ids if type(block_ids) is list else list(block_ids)
        ref_counts = self._ref_counts
        # The common case: blocks with this one holder each (none repeated) go free, in order.
        for index, block_id in enumerate(ids):
            if ref_counts[block_id] != 1:
                self._release_from(ids, index)
                return
            ref_counts[block_id] = 0
        self._enqueue(ids)

    def _enqueue(self, freed: list[int]) -> None:
        """Put blocks that just reached ref count 0 on the free list (see `release`)."""
        if not self._block_of_hash:
            self._fresh.extend(reversed(freed))
            return
        hash_of_block = self._hash_of_block
        unhashed = [b for b in freed if hash_of_block[b] is None]
        if len(unhashed) < len(freed):
            self._free.extend(b for b in freed if hash_of_block[b] is not None)
        self._fresh.extend(reversed(unhashed))

    def _release_from(self, ids: list[int], start: int) -> None:
        """`release`, its fast loop having freed `ids[:start]` (not yet on the free list): from
        `ids[start]` on come shared blocks, repeats, or a block without a holder."""
        ref_counts = self._ref_counts
        rest = ids[start:]
        try:
            self._check_releasable(rest)
        except ValueError:
            for block_id in ids[:start]:
                ref_counts[block_id] = 1
            raise
        freed = ids[:start]
        for block_id in rest:
            ref_count = ref_counts[block_id] - 1
            ref_counts[block_id] = ref_count
            if ref_count == 0:
                freed.append(block_id)
        self._enqueue(freed)

    def _check_releasable(self, block_ids: list[int]) -> None:
        """ValueError naming the first of `block_ids` released more often than it is held."""
        ref_counts = self._ref_counts
        if len(set(block_ids)) == len(block_ids) and 0 not in map(ref_counts.__getitem__, block_ids):
            return
        remaining: dict[int, int] = {}
        for block_id in block_ids:
            ref_count = remaining.get(block_id, ref_counts[block_id])
            if ref_count <= 0:
                raise ValueError(f"block {block_id} released but it has no holder")
            remaining[block_id] = ref_count - 1

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Record that held `block_id` is full and its contents hash to `block_hash`.

        Returns False (and changes nothing) when the block already records a hash or the hash
        is already cached by another block: the first block keeps it, so there are no duplicates.
        """
        return self.cache_all((block_id,), (block_hash,)) == 1

    def cache_all(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> int:
        """`cache` each pair of `zip(block_ids, block_hashes)` in order; how many were recorded.

        ValueError (and nothing changes) without prefix caching or when one of the blocks is free.
        """
        if not self.enable_prefix_caching:
            raise ValueError("prefix caching is disabled for this pool")
        ref_counts = self._ref_counts
        if 0 in map(ref_counts.__getitem__, block_ids[: len(block_hashes)]):
            free_id = next(b for b in block_ids if ref_counts[b] == 0)
            raise ValueError(f"block {free_id} is free: only a held block can be cached")
        hash_of_block = self._hash_of_block
        block_of_hash = self._block_of_hash
        num_cached = len(block_of_hash)
        for block_id, block_hash in zip(block_ids, block_hashes, strict=False):
            if hash_of_block[block_id] is None and block_hash not in block_of_hash:
                hash_of_block[block_id] = block_hash
                block_of_hash[block_hash] = block_id
        return len(block_of_hash) - num_cached

    # -- the free list's layout (see the module docstring) ---------------------------------------

    def _live_entries(self) -> list[int]:
        """The free list: `_free[_head:]` without its stale entries."""
        skip = dict(self._stale)
        live: list[int] = []
        for block_id in islice(self._free, self._head, None):
            num_skip = skip.get(block_id)
            if num_skip:
                skip[block_id] = num_skip - 1
            else:
                live.append(block_id)
        return live

    def _take_past_stale(self, num_blocks: int) -> tuple[list[int], int]:
        """The first `num_blocks` live entries from the head, consuming the stale ones passed; and
        the index after the last entry read."""
        free, stale = self._free, self._stale
        block_ids: list[int] = []
        i = self._head
        while len(block_ids) < num_blocks:
            block_id = free[i]
            i += 1
            num_stale = stale.get(block_id)
            if num_stale:
                if num_stale == 1:
                    del stale[block_id]
                else:
                    stale[block_id] = num_stale - 1
                self._num_stale -= 1
            else:
                block_ids.append(block_id)
        return block_ids, i

    def _drop_stale(self) -> None:
        self._free = self._live_entries()
        self._head = 0
        self._stale.clear()
        self._num_stale = 0

    def _drop_hashes(self, block_ids: list[int]) -> None:
        """Evict the cached hashes of freshly taken `block_ids` (those recording one)."""
        hash_of_block = self._hash_of_block
        block_of_hash = self._block_of_hash
        for block_id in block_ids:
            block_hash = hash_of_block[block_id]
            if block_hash is not None:
                del block_of_hash[block_hash]
                hash_of_block[block_id] = None

    def layout_errors(self) -> list[str]:
        """What is wrong with the free list's storage (empty when nothing is); for the invariant checks."""
        if not 0 <= self._head <= len(self._free):
            return [f"head {self._head} outside the list of {len(self._free)} entries"]
        errors: list[str] = []
        fresh = set(self._fresh)
        if len(fresh) < len(self._fresh):
            errors.append(f"a block twice at the head: {self._fresh}")
        for block_id in fresh:
            if self._ref_counts[block_id] or self._hash_of_block[block_id] is not None:
                errors.append(f"block {block_id} at the head is held or records a hash")
        if any(n <= 0 for n in self._stale.values()) or sum(self._stale.values()) != self._num_stale:
            errors.append(f"stale counts {self._stale} do not add up to {self._num_stale}")
        entries = Counter(islice(self._free, self._head, None))
        for block_id, num_entries in entries.items():
            # all but the newest entry are stale; that one too unless the block is free
            num_live = int(self._ref_counts[block_id] == 0 and block_id not in fresh)
            if num_entries != self._stale.get(block_id, 0) + num_live:
                errors.append(f"block {block_id}: {num_entries} entries, {self._stale.get(block_id, 0)} stale")
        missing = self._stale.keys() - entries.keys()
        if missing:
            errors.append(f"stale counts for blocks without entries: {sorted(missing)}")
        return errors
