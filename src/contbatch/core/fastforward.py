"""Fast-forward: the public scheduler API for taking steps whose every decision is foregone
without `schedule`/`update` (the simulator's decode runs, `contbatch.sim.decode_run`).

While every running request decodes one token per step and nothing waits, the coming steps are
fully determined: every running request gets its token, the batch shrinks as requests finish,
each request takes its next block at a block boundary, and an arriving request that fits at once
(a seat, its whole prompt in the step's budget, its first blocks above the watermark) is
admitted and prefilled whole. A caller that takes such steps in bulk needs the scheduler's rules
and a few state changes; `FastForward` is that API, and the rules it answers are the
scheduler's own (`plan_chunk`, `Memory.shortfall`, the seat limit), never restated.

`ContinuousScheduler.fast_forward()` gives one only when such steps are possible (under engine
semantics or the seed's, where a prefill samples nothing and the first token comes one step
later): no speculative decoding, output credits, timeouts, tenant KV quotas, prefix caching or
estimate admission, nothing waiting, and every running request steadily decoding and holding no more
blocks than its next token needs. Arrivals may be admitted inside only without tenant quotas,
fair-share accounting or a waiting-queue bound (`admits_arrivals`).

Invariants while one is open: the caller alone drives the scheduler until `close`; blocks the
caller counts as owed are not taken from the pool until `take_blocks` (at close), so the pool's
free count minus the owed blocks is what every decision meanwhile must see; `close` leaves the
scheduler exactly as the same steps taken one by one would have.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from contbatch.core.plan import plan_chunk
from contbatch.core.request import Request
from contbatch.core.status import FinishReason

if TYPE_CHECKING:
    from contbatch.core.scheduler import ContinuousScheduler


def may_fast_forward(s: ContinuousScheduler) -> bool:
    """Cheap pre-check (O(1)): could the next steps be taken by fast-forward at all?"""
    cfg = s.config
    memory = s.memory
    return bool(s.running) and not (
        s.waiting
        or cfg.num_speculative_tokens
        or cfg.lifecycle.output_credits is not None
        or cfg.lifecycle.has_timeouts
        or cfg.tenants.max_kv_blocks is not None  # growth is checked against the tenant's quota
        or len(s.running) > cfg.max_num_batched_tokens
        or (memory is not None and (memory.config.enable_prefix_caching or memory.config.admission == "estimate"))
    )


class FastForward:
    """See the module docstring. Obtained from `ContinuousScheduler.fast_forward()`."""

    def __init__(self, scheduler: ContinuousScheduler) -> None:
        self._s = s = scheduler
        memory = s.memory
        tenants = s.config.tenants
        self.first_step_id = s._step_id  # the id of the first step taken
        self.running: tuple[Request, ...] = tuple(s.running)  # at the start, in admission order
        self.block_size = memory.kv.block_size if memory is not None else 1
        self.num_blocks = memory.kv.num_blocks if memory is not None else 0
        # requests grow block by block (not under full reservation, not without a KV limit)
        self.tracks_growth = memory is not None and memory.config.admission != "reserve"
        self.admits_arrivals = (
            tenants.max_running is None
            and tenants.max_kv_blocks is None
            and not s.waiting.charges_service
            and s.config.lifecycle.max_waiting is None
        )
        self.max_num_batched_tokens = s.config.max_num_batched_tokens
        self.samples_on_prefill = s.config.sample_on_prefill  # else a prefill's first token comes a step later
        self.bucket_padding = s.bucket_padding_for  # tokens padding a step of n tokens to its bucket
        self._charges = s.waiting.charges_service
        self._kv = memory.kv if memory is not None else None
        self._memory = memory
        self._seats = s._max_seqs
        cfg = s.config
        # a fresh request's first chunk, planned as admission plans it (`Admission._plan`: no
        # speculative tokens or output credits here)
        self._plan = functools.partial(
            plan_chunk,
            sample_on_prefill=cfg.sample_on_prefill,
            allow_split=cfg.chunked_prefill,
            max_prefill_tokens=cfg.max_prefill_tokens_per_request,
        )

    # -- what the caller reads -----------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self._kv.num_free_blocks if self._kv is not None else 0

    def waiting(self, now: float) -> list[Request]:
        """The waiting requests in the order the queue offers them at `now`."""
        return list(self._s.waiting.candidates(now))

    def first_blocks(self, request: Request) -> int:
        """Blocks a new request's first allocation takes when it is admitted with its whole prompt."""
        memory = self._s.memory
        return memory.kv.num_blocks_for(memory.first_hold(request, request.num_prompt_tokens)) if memory else 0

    def fits_whole(
        self, request: Request, *, num_running: int, budget: int, free_blocks: int, alone: bool
    ) -> int | None:
        """The blocks admission would take for waiting `request` now with its whole prompt (a
        seat with `num_running` running, its prompt in `budget` tokens as one chunk, its first
        blocks out of `free_blocks` above the watermark, none when it would run `alone`); None
        when it would not be admitted so."""
        if num_running >= self._seats or request.num_external_tokens:
            return None  # (external KV: its first chunk is not its whole prompt; the scheduler decides)
        prompt = request.num_prompt_tokens
        chunk = self._plan(request, budget)
        if chunk is None or chunk.num_new_tokens != prompt:
            return None
        memory, kv = self._memory, self._kv
        if memory is None or kv is None:
            return 0
        if memory.shortfall(request, prompt, alone=alone, extra_free=free_blocks - kv.num_free_blocks):
            return None
        return kv.num_blocks_for(memory.first_hold(request, prompt))

    # -- what the caller changes ---------------------------------------------------------------
    def admit(self, request: Request, now: float, blocks: int) -> None:
        """Admit waiting `request` at `now` without taking its blocks: it is owed `blocks` (its
        first allocation, from `fits_whole`; taken by `take_blocks`), which its `kv_capacity`
        says it will hold."""
        s = self._s
        s.waiting.admitted(request)
        s.waiting.remove((request,))
        request.admit(now)
        request.kv_capacity = blocks * self.block_size

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
        """End a running request (its blocks, those it really holds, are freed); the pool's free
        blocks after."""
        self._s._finish(request, reason, now)
        return self.num_free_blocks()

    def take_blocks(self, request: Request, *, held_before: bool) -> bool:
        """Give a request still running the blocks it is owed: its growth (`held_before`: it held
        blocks before), or its whole first allocation plus growth (admitted in between)."""
        memory = self._s.memory
        assert memory is not None
        if held_before:
            return memory.grow(request, request.num_computed_tokens)
        request.kv_capacity = 0  # it held nothing in the pool yet
        first = memory.first_hold(request, request.num_prompt_tokens)
        return memory.reserve(request, max(first, request.num_computed_tokens))

    def close(self, running: Sequence[Request], *, num_steps: int, num_padding_tokens: int) -> None:
        """Hand the scheduler back after `num_steps` steps with `running` still running."""
        s = self._s
        memory = s.memory
        if memory is not None:
            for _ in range(num_steps):  # the estimate ratio's per-step decay, as stepping does it
                if memory.ratio == memory.config.estimate_min_ratio:
                    break
                memory.end_step(preempted=False)
        s.running = list(running)
        s._step_id += num_steps
        s.stats.num_bucket_padding_tokens += num_padding_tokens
