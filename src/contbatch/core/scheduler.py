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
  `max_partial_prefills` are in flight); without it a prompt runs whole or not at all. A
  waiting request that does not fit either blocks the queue behind it (`skip_blocked=False`,
  strict order) or is skipped so smaller ones may pass (`skip_blocked=True`, the seed's
  reference) unless it has waited `max_skip_age` or longer.
- With a KV budget (`kv`), a running request that cannot grow preempts a victim (possibly
  itself) by recompute or swap (`contbatch.core.memory`); a step that preempted admits nobody
  (no thrash). Waiting requests are admitted under the admission mode.
- With `batch_buckets`, the step's token count is padded up to the next bucket; the padding is
  token-work for no request.
- `update(out, result, now)` advances computed tokens, appends sampled tokens at `now` (the
  step's end) and finishes requests at their length or at the executor's stop/error.
- The scheduler never reads a clock: `now` is always an argument.

Invariants after every step (`contbatch.core.invariants.check_invariants`): the step's tokens
are within the budget, running requests within `max_num_seqs`, each unfinished request is in
exactly one of waiting / running, every finished one has exactly one reason.
"""

from __future__ import annotations

import bisect

from contbatch.core.base import SchedulerBase
from contbatch.core.outputs import ScheduledChunk, SchedulerOutput
from contbatch.core.plan import plan_chunk
from contbatch.core.request import Request
from contbatch.core.status import RequestStatus
from contbatch.core.step import StepBuilder
from contbatch.core.victims import choose_victim


class ContinuousScheduler(SchedulerBase):
    name = "continuous"

    def schedule(self, now: float) -> SchedulerOutput:
        step = StepBuilder(self.config.max_num_batched_tokens)
        if self.memory is not None:
            self.memory.begin_step(self.running)
        if self.config.prefill_first:
            self._schedule_running(step, now, prefills=True)
            self._admit_waiting(step, now)
            self._schedule_running(step, now, prefills=False)
        else:
            self._schedule_running(step, now, prefills=None)
            self._admit_waiting(step, now)
        if self.memory is not None:
            self.memory.end_step(preempted=bool(step.preempted_ids))
        padding = self._bucket_padding(self.config.max_num_batched_tokens - step.budget.remaining)
        out = step.build(self._next_step_id(), num_padding_tokens=padding, finished_ids=self._take_finished_ids())
        self.last_output = out
        return out

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

    # -- planning ----------------------------------------------------------------------------
    def _plan(self, request: Request, step: StepBuilder) -> ScheduledChunk | None:
        config = self.config
        return plan_chunk(
            request,
            step.budget.remaining,
            sample_on_prefill=config.sample_on_prefill,
            allow_split=config.chunked_prefill,
            num_speculative_tokens=config.num_speculative_tokens,
            max_prefill_tokens=config.max_prefill_tokens_per_request,
        )

    def _bucket_padding(self, num_tokens: int) -> int:
        buckets = self.config.batch_buckets
        if not buckets or num_tokens == 0:
            return 0
        i = bisect.bisect_left(buckets, num_tokens)
        if i == len(buckets):
            return 0  # larger than every captured size: runs eagerly, unpadded
        self.stats.num_bucket_padding_tokens += buckets[i] - num_tokens
        return buckets[i] - num_tokens

    # -- running requests --------------------------------------------------------------------
    def _schedule_running(self, step: StepBuilder, now: float, *, prefills: bool | None) -> None:
        for request in list(self.running):  # a copy: preemption edits self.running
            if step.budget.exhausted:
                break
            if request.status is not RequestStatus.RUNNING or request.request_id in step.chunks:
                continue
            chunk = self._plan(request, step)
            if chunk is None or (prefills is not None and chunk.is_prefill != prefills):
                continue
            if self._reserve_memory(request, chunk, step, now):
                step.budget.try_consume(chunk.num_new_tokens)
                step.add(chunk)

    def _reserve_memory(self, request: Request, chunk: ScheduledChunk, step: StepBuilder, now: float) -> bool:
        """Blocks for `chunk`, preempting victims while the pool is short; False when the request
        itself had to yield."""
        memory = self.memory
        if memory is None:
            return True
        end = chunk.start + chunk.num_new_tokens
        while not memory.grow(request, end):
            victim = choose_victim(self.running, memory.config.victim, memory.config.max_preemptions)
            self._preempt(victim, step, now)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, step: StepBuilder, now: float) -> None:
        assert self.memory is not None
        step.unschedule(victim.request_id)
        moved = self.memory.preempt(victim)
        victim.preempt(now, keep_computed=moved is not None)
        self.running.remove(victim)
        self.waiting.push_front(victim)
        step.preempted_ids.append(victim.request_id)
        if moved is not None:
            step.swapped_out.append((victim.request_id, moved))

    # -- waiting requests --------------------------------------------------------------------
    def _admit_waiting(self, step: StepBuilder, now: float) -> None:
        if step.preempted_ids:
            return  # no admissions in a step that preempted: no thrash
        admitted: list[Request] = []
        for request in self.waiting:
            if step.budget.exhausted or len(self.running) + len(admitted) >= self._max_seqs:
                break
            if self._try_admit(request, step):
                admitted.append(request)
            elif not self._may_pass(request, now):
                break
        if admitted:
            self.waiting.remove(admitted)
            for request in admitted:
                request.admit(now)
            self.running.extend(admitted)

    def _may_pass(self, blocked: Request, now: float) -> bool:
        """Whether requests behind a blocked one may be admitted before it."""
        age_limit = self.config.max_skip_age
        return self.config.skip_blocked and (age_limit is None or now - blocked.arrival_ts < age_limit)

    def _try_admit(self, request: Request, step: StepBuilder) -> bool:
        start = request.num_computed_tokens
        first_admission = start == 0 and request.num_preemptions == 0
        if self.memory is not None and first_admission:
            request.num_computed_tokens = self.memory.prefix_hit_tokens(request)
        chunk = self._plan(request, step)
        swapped_in = None if chunk is None else self._admission_memory(request, chunk, step)
        if chunk is None or swapped_in is None:
            request.num_computed_tokens = start  # refused: nothing changed
            return False
        if first_admission and self.memory is not None and self.memory.config.enable_prefix_caching:
            self.stats.num_prefix_query_tokens += request.num_prompt_tokens
            self.stats.num_prefix_hit_tokens += request.num_computed_tokens
        if swapped_in:
            step.swapped_in.append((request.request_id, swapped_in))
        if self._is_partial(request, chunk):
            step.num_new_partial_prefills += 1
        step.budget.try_consume(chunk.num_new_tokens)
        step.add(chunk)
        return True

    def _admission_memory(self, request: Request, chunk: ScheduledChunk, step: StepBuilder) -> tuple[int, ...] | None:
        """Device blocks a swapped-out request got back (empty tuple for others), or None when the
        request may not start now: too many partial prefills, or its memory does not fit."""
        cap = self.config.max_partial_prefills
        if cap is not None and self._is_partial(request, chunk):
            in_flight = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
            if in_flight + step.num_new_partial_prefills >= cap:
                return None
        return () if self.memory is None else self.memory.admit(request, chunk)

    @staticmethod
    def _is_partial(request: Request, chunk: ScheduledChunk) -> bool:
        return chunk.start + chunk.num_new_tokens < request.num_prompt_tokens
