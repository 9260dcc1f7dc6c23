"""The KV memory budget of one scheduler: admission modes, growth, preemption, prefix reuse.

Wraps a `KVCacheManager` (block accounting) with the policy choices of `KVConfig`:

- `reserve`: admission allocates blocks for prompt + output limit at once; a running request
  never needs another block, so nothing is ever preempted.
- `optimistic`: admission needs only the first chunk's blocks, above a watermark (or, with
  `admit_whole_sequence`, free blocks for everything the request knows, though only the first
  chunk's are taken: vLLM V1's gate); running requests grow block by block and, when the pool
  is empty, someone is preempted.
- `estimate`: like optimistic, but admission also keeps room for the expected growth of every
  running request and of the newcomer: ratio x (output limit - outputs so far). The ratio
  decays each step towards a floor and jumps up after a step that preempted (SGLang's
  new-token ratio).

A request preempted by recompute is re-admitted only when the blocks for everything it knew
(prompt and outputs so far) fit above the watermark, not just its next chunk: admitting it on
one chunk would squeeze it out again at once (the preemption loop).

Invariants: a request holds blocks only while RUNNING or swapped out; every allocation is
all-or-nothing, so a refused admission changes nothing; a request that could never fit (its
prompt plus output limit needs more blocks than the pool has) is rejected up front instead of
deadlocking the queue.
"""

from __future__ import annotations

from collections.abc import Sequence

from contbatch.core.block_hashes import extend_block_hashes
from contbatch.core.config import KVConfig
from contbatch.core.kv import KVCacheManager
from contbatch.core.outputs import ScheduledChunk
from contbatch.core.request import Request
from contbatch.core.stats import SchedulerStats


class Memory:
    def __init__(self, config: KVConfig, stats: SchedulerStats) -> None:
        self.config = config
        self.stats = stats
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=config.num_host_blocks if config.preemption == "swap" else 0,
        )
        self.watermark_blocks = 0 if config.admission == "reserve" else int(config.watermark * config.num_blocks)
        self.ratio = config.estimate_init_ratio
        self._future_blocks = 0  # estimate mode: growth kept free for the running requests this step

    # -- admission ---------------------------------------------------------------------------
    def never_fits(self, request: Request) -> str:
        """Why `request` can never be held whole by the pool; empty when it can."""
        need = self.kv.num_blocks_for(request.num_prompt_tokens + request.max_output_tokens)
        if need > self.kv.num_blocks:
            return (
                f"needs {need} KV blocks at its full length ({request.num_prompt_tokens} prompt + "
                f"{request.max_output_tokens} output tokens), the cache has {self.kv.num_blocks}"
            )
        return ""

    def begin_step(self, running: Sequence[Request]) -> None:
        if self.config.admission == "estimate":
            self._future_blocks = sum(self._expected_growth(r) for r in running)

    def end_step(self, preempted: bool) -> None:
        cfg = self.config
        if preempted:
            self.ratio = min(1.0, self.ratio + cfg.estimate_bump)
        else:
            self.ratio = max(cfg.estimate_min_ratio, self.ratio - cfg.estimate_decay)

    def _expected_growth(self, request: Request) -> int:
        remaining = request.max_output_tokens - request.num_output_tokens
        return self.kv.num_blocks_for(int(self.ratio * remaining + 0.5))

    def prefix_hit_tokens(self, request: Request) -> int:
        """Leading known tokens (prompt, then output after a recompute preemption) found in the
        prefix cache, in whole blocks and fewer than the known tokens (one must be computed to
        sample from), as vLLM; 0 without prefix caching."""
        return self._hit_blocks(request)[0] * self.kv.block_size

    def _hit_blocks(self, request: Request) -> tuple[int, int]:
        """(leading blocks of `request` cached, of which on the free list)."""
        if not self.config.enable_prefix_caching or request.skip_reading_prefix_cache:
            return 0, 0
        block_size = self.kv.block_size
        limit = (request.num_known_tokens - 1) // block_size
        extend_block_hashes(request, block_size, limit)
        return self.kv.match_prefix_free(request.block_hashes[:limit])

    def admit(self, request: Request, chunk: ScheduledChunk, *, alone: bool = False) -> tuple[int, ...] | None:
        """Allocate for a waiting request about to run `chunk`. Returns the device blocks a
        swapped-out request got back (empty tuple otherwise), or None when it does not fit (and
        then nothing changed). A request that would run `alone` needs no watermark or growth
        margin: it fits the pool (or it would have been rejected), so it must be able to start."""
        kv = self.kv
        end = chunk.start + chunk.num_new_tokens
        if kv.is_swapped(request.request_id):
            return self._swap_in(request, end, alone=alone)
        if self.shortfall(request, end, alone=alone):
            return None
        hold = self.first_hold(request, end)
        hits = request.block_hashes[: request.num_computed_tokens // kv.block_size] if kv.enable_prefix_caching else ()
        if not kv.allocate(request.request_id, hold, block_hashes=hits).granted:
            return None
        self._sync(request)
        if self.config.admission == "estimate":
            self._future_blocks += self._expected_growth(request)
        return ()

    def first_hold(self, request: Request, end: int) -> int:
        """Tokens to allocate at admission: the whole reservation, or the first chunk."""
        return request.num_prompt_tokens + request.max_output_tokens if self.config.admission == "reserve" else end

    def shortfall(self, request: Request, end: int, *, alone: bool = False, extra_free: int = 0) -> int:
        """Blocks missing to admit `request` with a first chunk ending at `end` (0 when it fits),
        were `extra_free` more blocks free."""
        kv = self.kv
        if kv.is_swapped(request.request_id):
            need = self.admission_blocks(request, end)
            margin = 0 if alone else self.watermark_blocks
        else:
            hold = self.first_hold(request, end)
            # thrash guard: a request preempted before comes back only when all it knew fits again
            # (with `admit_whole_sequence`, every request: vLLM V1's full-sequence admission gate)
            whole = request.num_preemptions or self.config.admit_whole_sequence
            room = max(hold, request.num_known_tokens) if whole else hold
            need = -(-room // kv.block_size)
            if kv.enable_prefix_caching:  # shared blocks need no new one (free ones still leave the free list)
                num_hits, num_free_hits = self._hit_blocks(request)
                need = max(need - num_hits + num_free_hits, 0)
            if self.config.admission == "estimate" and not alone:
                need += self._expected_growth(request)
            margin = 0 if alone else self.watermark_blocks + self._future_blocks
        return max(0, need + margin - kv.num_free_blocks - extra_free)

    def admission_blocks(self, request: Request, end: int) -> int:
        """Device blocks a waiting request admitted with a first chunk ending at `end` holds
        (without prefix caching): its first hold's, or, swapped out, its host copy's when more."""
        kv = self.kv
        blocks = kv.num_blocks_for(self.first_hold(request, end))
        return max(blocks, kv.num_held_host_blocks(request.request_id)) if kv.is_swapped(request.request_id) else blocks

    def _swap_in(self, request: Request, end: int, *, alone: bool) -> tuple[int, ...] | None:
        kv = self.kv
        if self.shortfall(request, end, alone=alone):
            return None
        grant = kv.swap_in(request.request_id)
        kv.allocate(request.request_id, self.first_hold(request, end))  # fits: checked above
        self._sync(request)
        self.stats.num_swap_ins += 1
        self.stats.num_swapped_in_blocks += len(grant.new_block_ids)
        return grant.new_block_ids

    # -- running requests --------------------------------------------------------------------
    def grow(self, request: Request, end: int) -> bool:
        """Make a running request hold blocks for `end` tokens; False when the pool is short."""
        if end <= request.kv_capacity:
            return True
        granted = self.kv.allocate(request.request_id, end).granted
        self._sync(request)
        return granted

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Allocate blocks for `num_tokens` at once (all-or-nothing)."""
        granted = self.kv.allocate(request.request_id, num_tokens).granted
        self._sync(request)
        return granted

    def _sync(self, request: Request) -> None:
        request.kv_capacity = self.kv.num_held_blocks(request.request_id) * self.kv.block_size

    def preempt(self, request: Request) -> tuple[int, ...] | None:
        """Release a preempted request's device blocks. With swap (and host room) its KV moves to
        host memory: returns the device blocks to copy out. Otherwise recompute: returns None."""
        stats = self.stats
        stats.num_preemptions += 1
        if self.config.preemption == "swap" and request.num_computed_tokens > 0:
            # only the computed tokens' KV is worth moving (blocks grown for this step's chunk are
            # not); a reservation is moved whole, so it is whole again when it comes back
            if self.config.admission != "reserve":
                self.kv.trim(request.request_id, request.num_computed_tokens)
            moved = self.kv.swap_out(request.request_id)
            request.kv_capacity = 0
            if moved.swapped:
                stats.num_swap_outs += 1
                stats.num_swapped_out_blocks += len(moved.device_block_ids)
                return moved.device_block_ids
        self.kv.free(request.request_id)
        request.kv_capacity = 0
        stats.num_recompute_preemptions += 1
        return None

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full computed blocks (prompt and output) for prefix reuse."""
        num_full = request.num_computed_tokens // self.kv.block_size
        extend_block_hashes(request, self.kv.block_size, num_full)
        self.kv.cache_blocks(request.request_id, request.block_hashes, request.num_computed_tokens)

    def roll_back(self, request: Request, num_tokens: int | None = None) -> None:
        """Give back blocks beyond `num_tokens` (default: `num_computed_tokens`; rejected
        speculative drafts, or blocks reserved for a chunk that got less budget)."""
        if self.config.admission != "reserve":
            self.kv.trim(request.request_id, request.num_computed_tokens if num_tokens is None else num_tokens)
            self._sync(request)

    def release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.kv_capacity = 0
