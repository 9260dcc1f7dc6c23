"""Continuous (iteration-level) batching: the batch is rebuilt at every step.

The scheduling model, stated once:

- Each request has `num_known_tokens` (prompt plus outputs sampled so far) and
  `num_computed_tokens` (positions whose KV exists). A step gives some requests
  `num_new_tokens` that close that gap; prefill, chunked prefill and decode are not separate
  phases, only different sizes of the same chunk (see `contbatch.core.plan`).
- `schedule(now)` serves running requests first, in admission order, then offers waiting
  requests in queue order, all within one `TokenBudget` (`max_num_batched_tokens`) and
  `max_num_seqs` running requests (`prefill_first` puts prefill chunks, running or new, ahead
  of decodes instead). With `chunked_prefill` a prompt takes whatever budget is left (at most
  `max_prefill_tokens_per_request`, and new partial prefills only while fewer than
  `max_partial_prefills` are in flight, and with `defer_partial_prefills` none in a step in
  which a prefill chunk already samples); without it a prompt runs whole or not at all. A
  waiting request that does not fit either blocks the queue behind it (`skip_blocked=False`,
  strict order) or is skipped so smaller ones may pass (`skip_blocked=True`, the seed's
  reference) unless it has waited `max_skip_age` or longer.
- With a KV budget (`kv`), a running request that cannot grow preempts a victim (possibly
  itself) by recompute or swap (`contbatch.core.memory`); a step that preempted admits nobody
  (no thrash). Waiting requests are admitted under the admission mode.
- With `batch_buckets`, the step's token count is padded up to the next bucket; the padding is
  token-work for no request.
- Lifecycle (`contbatch.core.lifecycle`): at the start of a step, requests past their timeouts
  end with TIMEOUT and running requests paused too long (their client not reading) are
  preempted or ended; a running request with no output credits left is paused, not scheduled.
- Who is offered next, quotas and priority preemption live in `contbatch.core.admission`.
- `update(out, result, now)` advances computed tokens, appends sampled tokens at `now` (the
  step's end) and finishes requests at their length or at the executor's stop/error.
- The scheduler never reads a clock: `now` is always an argument.

Invariants after every step (`contbatch.core.invariants.check_invariants`): the step's tokens
are within the budget, running requests within `max_num_seqs`, each unfinished request is in
exactly one of waiting / running, every finished one has exactly one reason.
"""

from __future__ import annotations

import bisect

from mypy_extensions import mypyc_attr

from contbatch.core.admission import Admission
from contbatch.core.fastforward import FastForward, open_fast_forward
from contbatch.core.lifecycle import paused_too_long
from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, new_chunk
from contbatch.core.request import Request
from contbatch.core.status import FinishReason, RequestStatus
from contbatch.core.step import StepBuilder
from contbatch.core.victims import choose_victim


@mypyc_attr(allow_interpreted_subclasses=True)  # an extension point (docs/extending.md)
class ContinuousScheduler(Admission):
    name = "continuous"

    def schedule(self, now: float) -> SchedulerOutput:
        step = StepBuilder(self.config.max_num_batched_tokens)
        if self.config.lifecycle.has_timeouts:
            self._expire(step, now)
        if self.memory is not None:
            self.memory.begin_step(self.running)
        if self.config.prefill_first:
            self._schedule_running(step, now, prefills=True)
            self._reserve_decodes(step, now)  # memory first, so admission sees what is left
            self._admit_waiting(step, now)
            self._schedule_running(step, now, prefills=False)
            self._release_unscheduled(step)
        else:
            self._schedule_running(step, now, prefills=None)
            self._admit_waiting(step, now)
        if self.memory is not None:
            self.memory.end_step(preempted=step.grew_by_preempting)
        padding = self._bucket_padding(self.config.max_num_batched_tokens - step.budget.remaining)
        out = step.build(
            self._next_step_id(),
            num_padding_tokens=padding,
            finished_ids=self._take_finished_ids(),
            block_deltas=self._take_block_deltas(),
        )
        self.last_output = out
        return out

    def fast_forward(self) -> FastForward | None:
        """The API for taking the coming steps in bulk (`contbatch.core.fastforward`), or None
        when they are not all foregone (`open_fast_forward` says when)."""
        return open_fast_forward(self)

    def rejection(self, request: Request) -> tuple[str, str]:
        kind, reason = super().rejection(request)
        budget = self.config.max_num_batched_tokens
        if not reason and not self.config.chunked_prefill and request.num_prompt_tokens > budget:
            kind = "token_budget"
            reason = (
                f"prompt of {request.num_prompt_tokens} tokens exceeds the step token budget of "
                f"{budget} and chunked prefill is off"
            )
        return kind, reason

    def _bucket_padding(self, num_tokens: int) -> int:
        padding = self.bucket_padding_for(num_tokens)
        self.stats.num_bucket_padding_tokens += padding
        return padding

    def bucket_padding_for(self, num_tokens: int) -> int:
        """Tokens that pad a step of `num_tokens` up to the next batch bucket (0 above the
        largest: that step runs eagerly, unpadded)."""
        buckets = self.config.batch_buckets
        if not buckets or num_tokens == 0:
            return 0
        i = bisect.bisect_left(buckets, num_tokens)
        return buckets[i] - num_tokens if i < len(buckets) else 0

    # -- lifecycle ---------------------------------------------------------------------------
    def _expire(self, step: StepBuilder, now: float) -> None:
        self.expire_timeouts(now)
        lifecycle = self.config.lifecycle
        for request in list(self.running):
            if paused_too_long(request, lifecycle, now):
                self._end_pause(request, step, now)

    def _end_pause(self, request: Request, step: StepBuilder, now: float) -> None:
        limit = self.config.lifecycle.max_pause
        if self.config.lifecycle.pause_action == "cancel":
            detail = f"the client read nothing for {limit:g} (max_pause)"
            self.cancel(request.request_id, now, FinishReason.TIMEOUT, detail=detail)
        elif self.waiting:  # someone waits for its seat or its memory; else it keeps both
            self._preempt(request, step, now)
            self.stats.num_pause_preemptions += 1

    # -- running requests --------------------------------------------------------------------
    def _schedule_running(self, step: StepBuilder, now: float, *, prefills: bool | None) -> None:
        # steady decoding (one token at the end of the sequence, its block already held) skips the
        # general planner and the memory layer: this loop runs for every running request every step
        config = self.config
        fast = config.sample_on_prefill and not config.num_speculative_tokens
        fast = fast and config.lifecycle.output_credits is None and prefills is None
        budget = step.budget
        chunks = step.chunks
        running = RequestStatus.RUNNING
        for request in list(self.running):  # a copy: preemption edits self.running
            remaining = budget.remaining
            if not remaining:
                break
            rid = request.request_id
            if request.status is not running or rid in chunks:
                continue
            start = request.num_computed_tokens
            prompt = request.num_prompt_tokens
            if fast and start >= prompt and start == prompt + request.num_output_tokens - 1:
                if request.kv_capacity > start:  # its next token's block is held: nothing to reserve
                    budget.remaining = remaining - 1
                    chunks[rid] = new_chunk(ScheduledChunk, (rid, start, 1, False, True))
                    continue
                chunk: ScheduledChunk | None = new_chunk(ScheduledChunk, (rid, start, 1, False, True))
            else:
                chunk = self._plan(request, step)
            if chunk is None:
                if request.num_unsent_tokens and config.lifecycle.output_credits is not None:
                    request.pause(now)  # its client has not read: no credits left
                continue
            if prefills is not None and chunk.is_prefill != prefills:
                continue
            if request.kv_capacity >= start + chunk.num_new_tokens or self._reserve_memory(request, chunk, step, now):
                budget.remaining -= chunk.num_new_tokens  # planned within the remaining budget
                chunks[rid] = chunk

    def _reserve_decodes(self, step: StepBuilder, now: float) -> None:
        """prefill_first: the running decodes take their blocks before admission (preempting if
        they must), though their tokens come out of the budget only after the prefills."""
        if self.memory is None:
            return
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.request_id in step.chunks:
                continue
            chunk = self._plan(request, step)
            if chunk is not None and not chunk.is_prefill:
                self._reserve_memory(request, chunk, step, now)

    def _release_unscheduled(self, step: StepBuilder) -> None:
        """Decodes that got less budget than they reserved memory for (none, or fewer draft
        tokens) give back the blocks they will not use."""
        if self.memory is None:
            return
        block_size = self.memory.kv.block_size
        for request in self.running:
            chunk = step.chunks.get(request.request_id)
            end = request.num_computed_tokens + (chunk.num_new_tokens if chunk is not None else 0)
            if request.kv_capacity - end >= block_size:
                self.memory.roll_back(request, end)

    def _reserve_memory(self, request: Request, chunk: ScheduledChunk, step: StepBuilder, now: float) -> bool:
        """Blocks for `chunk`, preempting victims while its tenant is at its KV quota (victims of
        that tenant) or the pool is short; False when the request itself had to yield."""
        memory = self.memory
        if memory is None:
            return True
        end = chunk.start + chunk.num_new_tokens
        quota = self.config.tenants.max_kv_blocks
        while (
            quota is not None
            and self._tenant_blocks(request.tenant) + memory.kv.blocks_needed(request.request_id, end) > quota
        ):
            if self._yield_to(request, [r for r in self.running if r.tenant == request.tenant], step, now):
                return False
        while not memory.grow(request, end):
            if self._yield_to(request, self.running, step, now):
                return False
        return True

    def _tenant_blocks(self, tenant: str | None) -> int:
        assert self.memory is not None
        kv = self.memory.kv
        return sum(kv.num_held_blocks(r.request_id) for r in self.running if r.tenant == tenant)

    def _yield_to(self, request: Request, among: list[Request], step: StepBuilder, now: float) -> bool:
        """Preempt a victim among `among` (a paused one first: its client is not reading, it would
        not use the memory) so that `request` can grow; True when the victim is `request` itself."""
        assert self.memory is not None
        config = self.memory.config
        candidates = [r for r in among if r.request_id not in step.admitted_ids]
        candidates = [r for r in candidates if r.paused_since is not None] or candidates
        victim = choose_victim(candidates, config.victim, config.max_preemptions)
        self._preempt(victim, step, now)
        step.grew_by_preempting = True
        return victim is request
