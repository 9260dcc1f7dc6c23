"""The paged-KV block layer: a `BlockPool` of fixed-size blocks and the `KVCacheManager` that keeps
each request's block table (prefix caching, speculative rollback, swap to a host pool).

Standard library only, no clock. Every answer is a frozen `Grant` / `SwapOut`, never a sentinel;
invalid calls raise ValueError; `check_invariants` raises `KVInvariantError`.
"""

from contbatch.core.kv.invariants import KVInvariantError
from contbatch.core.kv.manager import Grant, KVCacheManager, SwapOut
from contbatch.core.kv.pool import BlockPool

__all__ = ["BlockPool", "Grant", "KVCacheManager", "KVInvariantError", "SwapOut"]
