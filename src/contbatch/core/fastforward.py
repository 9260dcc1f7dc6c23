"""Fast-forward: the public scheduler API for taking steps whose every decision is foregone
without `schedule`/`update` (the simulator's decode runs, `contbatch.sim.decode_run`).

While every running request decodes one token per step (but, perhaps, the newest, which is
computing its prompt in chunks), the coming steps are determined by rules a caller can apply
without the per-request work of a step: every decoding request gets its token, the batch shrinks
as requests finish, each request takes its next block at a block boundary, the prefilling request
takes what the budget leaves, and the waiting requests are offered in queue order, each admitted
when it fits (a seat, its first chunk in the step's budget, its first blocks above the watermark)
until one does not: then it and those behind it wait. A caller that takes such steps in bulk
needs the scheduler's rules and a few state changes; `FastForward` is that API, and the rules it
answers are the scheduler's own (`plan_chunk`, `Memory.shortfall`, the seat limit), never restated.

`ContinuousScheduler.fast_forward()` gives one only when such steps are possible (under engine
semantics or the seed's, where a prefill samples nothing and the first token comes one step
later): no speculative decoding, output credits, timeouts, tenant KV quotas or estimate
admission; every running request steadily decoding and holding no more blocks than its
next token needs, but the newest, which may be part-way through computing what it knows; and,
when requests wait or one is prefilling, an admission phase with nothing else to decide:
`admits` (no tenant seat quota, fair-share accounting or waiting-queue bound), decodes before
prefills (not `prefill_first`), a blocked request blocking the queue (not `skip_blocked`), no
priority preemption, no cap on a request's chunk or on partial prefills and none deferred (so
a partial prefill always takes the rest of the budget and is the newest running request).
`admits` alone allows admitting arrivals into an otherwise idle queue.

Invariants while one is open: the caller alone drives the scheduler until `close`; blocks the
caller counts as owed are not taken from the pool until `hold` (at close), so the pool's
free count minus the owed blocks is what every decision meanwhile must see; `close` leaves the
scheduler exactly as the same steps taken one by one would have.

A KV shortage is a decision the caller may take too: in running order, each request that cannot
grow preempts the victim the KV config's rule picks among the running requests (`victim_index`;
itself, perhaps) until it can, and that step admits nobody; `preempt` makes each such change, by
recompute or by swap as the KV config says (a swap without host room falls back to recompute,
as in `schedule`). Which victims go and the device blocks they free do not depend on how they
are preempted. A swapped-out request waiting is admitted like any other (`admission`: its blocks
are those its swap-in takes); `swap_in` admits it, its blocks taken from the pool at once.

With prefix caching the caller caches blocks late too: a request's full blocks when it finishes
or is preempted (`finish`, `preempt`) and at `close`, the prefilling request's as its chunks
complete (`computed`) up to the blocks it holds. Before any block returns to the pool the caller
takes every block it counted (`take_owed`): blocks return hashed to the free list's tail or
unhashed to its head, so a take after a return could draw another place than stepping's; between
returns the takes draw the same places, and so evict the same cached blocks, whoever takes them.
That leaves every decision and the cache as stepping leaves them while the cache decides no
admission the caller takes (`admits`): a waiting request none of whose hashes is cached, and
whose first block is no prompt's the caller caches late, hits nothing when stepping either, and
its blocks are cached as stepping caches them (no other block holds their hash; output blocks
hash with their request's id). A run does not open while a recomputed request, or the prefilling
one, finds a hash of its own on a block it does not hold (`caches_elsewhere`). A victim frees
only the blocks no other request shares, which the caller's count of what it holds would not see:
a step that preempts is the scheduler's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from contbatch.core.outputs import ScheduledChunk
from contbatch.core.request import Request
from contbatch.core.status import FinishReason
from contbatch.core.victims import victim_index

if TYPE_CHECKING:
    from contbatch.core.scheduler import ContinuousScheduler


def may_fast_forward(s: ContinuousScheduler) -> bool:
    """Cheap pre-check (O(1)): could the next steps be taken by fast-forward at all?"""
    cfg = s.config
    memory = s.memory
    return bool(s.running) and not (
        (s.waiting and not _plain_admission(s))
        or cfg.num_speculative_tokens
        or cfg.lifecycle.output_credits is not None
        or cfg.lifecycle.has_timeouts
        or cfg.tenants.max_kv_blocks is not None  # growth is checked against the tenant's quota
        or len(s.running) > cfg.max_num_batched_tokens
        or (memory is not None and memory.config.admission == "estimate")
    )


def _admits(s: ContinuousScheduler) -> bool:
    """Whether admitting a request needs nothing but its seat, its chunk and its blocks."""
    return (
        s.config.tenants.max_running is None
        and s.config.tenants.max_kv_blocks is None
        and not s.waiting.charges_service
        and s.config.lifecycle.max_waiting is None
    )


def _plain_admission(s: ContinuousScheduler) -> bool:
    """Whether a step's admission phase can be taken by the caller: `admits`, after every
    running request's chunk (decodes first, the one partial prefill last, taking what is left),
    stopping at the first waiting request that does not fit (see the module docstring)."""
    cfg = s.config
    return (
        _admits(s)
        and not cfg.prefill_first
        and not cfg.skip_blocked
        and cfg.priority_preemption is None
        and cfg.max_partial_prefills is None
        and cfg.max_prefill_tokens_per_request is None
        and not cfg.defer_partial_prefills
    )


def open_fast_forward(s: ContinuousScheduler) -> FastForward | None:
    """`ContinuousScheduler.fast_forward()`: a `FastForward`, or None when the coming steps are
    not all foregone (the configuration or the queue rules it out, or a running request is not
    steadily decoding, or holds more blocks than its next token needs, or is computing what it
    knows without being the newest, under a plain admission phase)."""
    if not may_fast_forward(s):
        return None
    ff = FastForward(s)
    # steady: one position to compute per step, at the sequence end (under the seed's semantics
    # the decode unit that samples the next token computes a position past the known ones)
    lag = 1 if ff.samples_on_prefill else 0
    running = s.running
    for r in running:
        computed = r.num_computed_tokens
        if r.num_preemptions and ff.caches_elsewhere(r):
            return None  # (recomputed: a block it fills may find its hash on a block it held before)
        if computed >= r.num_prompt_tokens and computed == r.num_known_tokens - lag:  # steady
            if ff.tracks_growth and not 0 <= r.kv_capacity - computed < ff.block_size:
                return None
        elif r is running[-1] and ff.plain_admission and not ff.caches_elsewhere(r):
            ff.prefilling = r  # computing its prompt (or, after a preemption, all it knew) in chunks
            ff.defer_prefix(r)
        else:
            return None
    return ff


class FastForward:
    """See the module docstring. Obtained from `ContinuousScheduler.fast_forward()`."""

    def __init__(self, scheduler: ContinuousScheduler) -> None:
        self._s = s = scheduler
        memory = s.memory
        self.first_step_id = s._step_id  # the id of the first step taken
        self.running: tuple[Request, ...] = tuple(s.running)  # at the start, in admission order
        self.block_size = memory.kv.block_size if memory is not None else 1
        self.num_blocks = memory.kv.num_blocks if memory is not None else 0
        # requests grow block by block (not under full reservation, not without a KV limit)
        self.tracks_growth = memory is not None and memory.config.admission != "reserve"
        self.admits_arrivals = _admits(s)
        # the admission phase is the caller's to take whatever it decides (else only when every
        # waiting request is admitted with its whole prompt: see the module docstring)
        self.plain_admission = _plain_admission(s)
        self.prefilling: Request | None = None  # the newest running request, computing what it knows
        self.max_num_batched_tokens = s.config.max_num_batched_tokens
        self.samples_on_prefill = s.config.sample_on_prefill  # else a prefill's first token comes a step later
        self.bucket_padding = s.bucket_padding_for  # tokens padding a step of n tokens to its bucket
        self._charges = s.waiting.charges_service
        self._kv = memory.kv if memory is not None else None
        self._memory = memory
        self._seats = s._max_seqs
        # a running request that cannot grow preempts a victim (`victim_index`, `preempt`)
        self._kv_config = memory.config if memory is not None else None
        self.swaps = memory is not None and memory.config.preemption == "swap"  # (recompute when the host is full)
        self._preempting_steps: list[int] = []  # the caller's steps (0-based) that preempted, in order
        # prefix caching: blocks are cached as they fill, which the caller defers (see `admits`)
        self.caches_prefixes = memory is not None and memory.config.enable_prefix_caching
        self._deferred_prefixes: set[int] = set()  # first block hashes of prompts cached late

    def caches_elsewhere(self, request: Request) -> bool:
        """With prefix caching, whether a hash of `request`'s blocks is cached by a block it does
        not hold (a running request's own block would then not be cached when it fills)."""
        if not self.caches_prefixes or not request.block_hashes:
            return False
        kv = self._kv
        assert kv is not None
        cached, own = kv.pool.cached_block_ids(), set(kv.block_table(request.request_id))
        return any([cached.get(h, -1) not in own for h in request.block_hashes if h in cached])

    def defer_prefix(self, request: Request) -> None:
        """`request`'s prompt blocks are cached late (it computes its prompt inside the run)."""
        if self.caches_prefixes and request.block_hashes:
            self._deferred_prefixes.add(request.block_hashes[0])

    # -- what the caller reads -----------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self._kv.num_free_blocks if self._kv is not None else 0

    def waiting(self, now: float) -> Iterator[Request]:
        """The waiting requests in the order the queue offers them at `now` (do not admit any
        while iterating)."""
        return self._s.waiting.candidates(now)

    def has_waiting(self) -> bool:
        return bool(self._s.waiting)

    def admits(self, request: Request, planned: Sequence[Request] = ()) -> bool:
        """Whether the caller may admit waiting `request` (by `admission`): every one but a
        request whose KV arrives from elsewhere (the scheduler counts it as computed when it
        admits it) or whose admission the prefix cache could decide (`_cache_decides`). Its first
        chunk starts where its KV ends: at its first position, or, swapped out (`is_swapped`),
        after the tokens its KV holds. `planned`: the requests admitted before it in the step."""
        if request.num_external_tokens and not request.num_preemptions:
            return False
        return not self._cache_decides(request, planned)

    def _cache_decides(self, request: Request, planned: Sequence[Request]) -> bool:
        """Whether the prefix cache could decide waiting `request`'s admission, or its blocks'
        caching later: one of its blocks' hashes is cached now, or its first block's is that of
        a prompt the caller caches late (`defer_prefix`) or of a `planned` request. Otherwise it
        hits nothing now or when stepping (where blocks are cached as they fill: the caller's
        cache lacks only the late prompts'), and its blocks will be cached as stepping caches
        them (no other block holds their hash)."""
        if not self.caches_prefixes:
            return False
        memory = self._memory
        assert memory is not None
        if not self.is_swapped(request):  # (stepping queries no hit for a swapped-out one)
            memory.prefix_hit_tokens(request)  # (its hashes over what it knows, as `schedule` extends them)
        first = request.block_hashes[:1]
        if first and (first[0] in self._deferred_prefixes or any([r.block_hashes[:1] == first for r in planned])):
            return True
        return self.caches_elsewhere(request)  # (it holds no block: any of its hashes cached)

    def is_swapped(self, request: Request) -> bool:
        """Whether waiting `request`'s KV is in host memory (admitted by `swap_in`)."""
        return self._kv is not None and self._kv.is_swapped(request.request_id)

    def plan(self, request: Request, budget: int) -> ScheduledChunk | None:
        """`request`'s next chunk within `budget` tokens, as the scheduler plans it
        (`Admission.plan_within`: a waiting request's first chunk, or a running one's next)."""
        return self._s.plan_within(request, budget)

    def computed(self, request: Request, chunk: ScheduledChunk) -> None:
        """`request` computed `chunk` (not sampling: tokens come with the caller's `emit`), as
        `update` applies it: its computed tokens, and the recomputed ones counted."""
        if chunk.is_prefill:
            self._s.advance_prefill(request, chunk)
        else:
            request.num_computed_tokens = chunk.start + chunk.num_new_tokens

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return self._kv.num_blocks_for(num_tokens) if self._kv is not None else 0

    def admission(
        self, request: Request, *, num_running: int, budget: int, free_blocks: int, alone: bool
    ) -> tuple[ScheduledChunk, int] | None:
        """(its first chunk, the blocks it takes) when admission would admit waiting `request`
        (one the caller `admits`) now: a seat with `num_running` running, its first chunk planned
        within `budget` tokens, its first blocks (a swapped-out request's: those its swap-in
        takes) out of `free_blocks` above the watermark (none when it would run `alone`); None
        when it would not."""
        if num_running >= self._seats:
            return None
        chunk = self.plan(request, budget)
        if chunk is None:
            return None
        memory, kv = self._memory, self._kv
        if memory is None or kv is None:
            return chunk, 0
        end = chunk.start + chunk.num_new_tokens
        if memory.shortfall(request, end, alone=alone, extra_free=free_blocks - kv.num_free_blocks):
            return None
        return chunk, memory.admission_blocks(request, end)

    # -- what the caller changes ---------------------------------------------------------------
    def admit(self, request: Request, now: float, blocks: int) -> None:
        """Admit waiting `request` at `now` without taking its blocks: it is owed `blocks` (its
        first allocation, from `admission`; taken by `hold`), which its `kv_capacity`
        says it will hold."""
        s = self._s
        s.waiting.admitted(request)
        s.waiting.remove((request,))
        request.admit(now)
        request.kv_capacity = blocks * self.block_size
        if self.caches_prefixes:  # no hit (`admits`): a first admission queries its prompt, as `schedule` counts it
            if not request.num_preemptions:
                s.stats.num_prefix_query_tokens += request.num_prompt_tokens
            self.defer_prefix(request)

    def swap_in(self, request: Request, chunk: ScheduledChunk, now: float) -> tuple[int, ...]:
        """Admit swapped-out waiting `request` at `now` with `chunk` (its `admission` answered:
        it fits): its KV back in device blocks taken from the pool now, those blocks returned."""
        memory = self._s.memory
        assert memory is not None and self.is_swapped(request)
        moved = memory.admit(request, chunk, alone=True)  # (no margin: `admission` checked the fit)
        assert moved, f"swap_in: {request.request_id!r} did not fit"
        self.defer_prefix(request)  # (its blocks are cached again as they were: late)
        s = self._s
        s.waiting.admitted(request)
        s.waiting.remove((request,))
        request.admit(now)
        return moved

    def emit(self, request: Request, ts: list[float], num_computed_tokens: int) -> None:
        """`request` decoded one (dummy) token at each of `ts` and now has `num_computed_tokens`
        (its outputs, timeline and fair-share service brought up to date)."""
        request.output_token_ids.extend([0] * len(ts))
        request.num_output_tokens += len(ts)
        request.num_computed_tokens = num_computed_tokens
        request.timeline.record_token_run(ts)
        if self._charges:
            self._s.waiting.charge(request, len(ts))

    def finish(self, request: Request, reason: FinishReason, now: float) -> int:
        """End a running request (its blocks, those it really holds, are freed; with prefix caching
        its full blocks cached first, as stepping caches them, so the caller holds them all); the
        pool's free blocks after."""
        self._cache_blocks(request)
        self._s._finish(request, reason, now)
        return self.num_free_blocks()

    def victim_index(self, running: Sequence[Request], generated: Sequence[int]) -> int:
        """The index in `running` (running order, none admitted in this step) of the request the
        scheduler preempts when one of them cannot grow (`contbatch.core.victims` under the KV
        config), `generated[i]` being the tokens `running[i]` has generated (the caller's count:
        a request's own may lag behind the caller's steps)."""
        config = self._kv_config
        assert config is not None, "victim_index: no KV limit, no victim"
        return victim_index(running, config.victim, config.max_preemptions, generated)

    def preempt(self, request: Request, now: float, step: int) -> tuple[int, ...] | None:
        """Preempt running `request` at `now`, in the caller's `step` (0-based), as the scheduler
        does when a running request cannot grow: by recompute or swap per the KV config
        (`Admission.release_victim`), the blocks it really holds freed (`hold` first the blocks a
        swap must move), to the front of the queue. The device blocks swapped out, or None
        (recompute)."""
        assert self._kv_config is not None, "preempt: no KV limit, no preemption"
        s = self._s
        self._cache_blocks(request)
        moved = s.release_victim(request, now)
        s.waiting.push_front(request)
        if not self._preempting_steps or self._preempting_steps[-1] != step:
            self._preempting_steps.append(step)
        return moved

    def take_owed(self, request: Request, num_blocks: int) -> None:
        """Take from the pool `num_blocks` more blocks for running `request` (blocks the caller
        counted it to hold), its counted `kv_capacity` kept."""
        kv = self._kv
        assert kv is not None
        capacity = request.kv_capacity
        rid = request.request_id
        granted = self.hold(request, (kv.num_held_blocks(rid) + num_blocks) * kv.block_size)
        assert granted, f"take_owed: no block for {rid!r}"
        request.kv_capacity = capacity

    def _cache_blocks(self, request: Request) -> None:
        """With prefix caching, `request`'s full computed blocks cached (it holds them all)."""
        if self.caches_prefixes:
            memory = self._memory
            assert memory is not None
            memory.cache_computed_blocks(request)

    def hold(self, request: Request, num_tokens: int) -> bool:
        """Make running `request` hold blocks for `num_tokens` tokens from the pool (keeping those it
        held before; its `kv_capacity`, perhaps counted ahead, set from what it really holds)."""
        memory = self._s.memory
        assert memory is not None
        kv = memory.kv
        request.kv_capacity = kv.num_held_blocks(request.request_id) * kv.block_size
        return memory.grow(request, num_tokens)

    def first_hold(self, request: Request, end: int) -> int:
        """Tokens a request admitted with a first chunk ending at `end` holds blocks for."""
        memory = self._s.memory
        return memory.first_hold(request, end) if memory is not None else 0

    def close(self, running: Sequence[Request], *, num_steps: int, num_padding_tokens: int) -> None:
        """Hand the scheduler back after `num_steps` steps with `running` still running."""
        s = self._s
        memory = s.memory
        if memory is not None:  # the estimate ratio's per-step change, as stepping makes it
            preempting = set(self._preempting_steps)
            last = self._preempting_steps[-1] if preempting else -1
            for i in range(num_steps):
                preempted = i in preempting
                if not preempted and i > last and memory.ratio == memory.config.estimate_min_ratio:
                    break  # at its floor, with no bump to come: decays change nothing
                memory.end_step(preempted=preempted)
        for r in running:  # (with prefix caching: the blocks stepping would have cached by now)
            self._cache_blocks(r)
        s.running = list(running)
        s._step_id += num_steps
        s.stats.num_bucket_padding_tokens += num_padding_tokens
