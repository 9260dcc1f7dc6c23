"""Continuous (iteration-level) batching: the batch is rebuilt at every step.

The scheduling model, stated once:

- Each request has `num_known_tokens` (prompt plus outputs sampled so far) and
  `num_computed_tokens` (positions whose KV exists). A step gives some requests
  `num_new_tokens` that close that gap; prefill, chunked prefill and decode are not separate
  phases, only different sizes of the same chunk (see `contbatch.core.plan`).
- `schedule(now)` serves running requests first, in admission order, then offers waiting
  requests in queue order, all within one `TokenBudget` (`max_num_batched_tokens`) and
  `max_num_seqs` running requests. With `chunked_prefill` a prompt takes whatever budget is
  left; without it a prompt runs whole or not at all. A waiting request that does not fit
  either blocks the queue behind it (`skip_blocked=False`, strict order) or is skipped so
  smaller ones may pass (`skip_blocked=True`, the seed's reference).
- `update(out, result, now)` advances computed tokens, appends sampled tokens at `now` (the
  step's end) and finishes requests at their length or at the executor's stop/error.
- The scheduler never reads a clock: `now` is always an argument.

Invariants after every step (`contbatch.core.invariants.check_invariants`): the step's tokens
are within the budget, running requests within `max_num_seqs`, each unfinished request is in
exactly one of waiting / running, every finished one has exactly one reason.
"""

from __future__ import annotations

from contbatch.core.base import SchedulerBase
from contbatch.core.budget import TokenBudget
from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.core.plan import plan_chunk
from contbatch.core.request import Request


class ContinuousScheduler(SchedulerBase):
    name = "continuous"

    def schedule(self, now: float) -> SchedulerOutput:
        budget = TokenBudget(self.config.max_num_batched_tokens)
        chunks: list[ScheduledChunk] = []
        self._schedule_running(budget, chunks)
        self._admit_waiting(budget, chunks, now)
        out = build_output(self._next_step_id(), chunks, finished_ids=self._take_finished_ids())
        self.last_output = out
        return out

    def rejection_reason(self, request: Request) -> str:
        reason = super().rejection_reason(request)
        budget = self.config.max_num_batched_tokens
        if not reason and not self.config.chunked_prefill and request.num_prompt_tokens > budget:
            reason = (
                f"prompt of {request.num_prompt_tokens} tokens exceeds the step token budget of "
                f"{budget} and chunked prefill is off"
            )
        return reason

    def _chunk(self, request: Request, budget: TokenBudget) -> ScheduledChunk | None:
        chunk = plan_chunk(
            request,
            budget.remaining,
            sample_on_prefill=self.config.sample_on_prefill,
            allow_split=self.config.chunked_prefill,
        )
        if chunk is not None:
            budget.try_consume(chunk.num_new_tokens)
        return chunk

    def _schedule_running(self, budget: TokenBudget, chunks: list[ScheduledChunk]) -> None:
        for request in self.running:
            if budget.exhausted:
                break
            chunk = self._chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)

    def _admit_waiting(self, budget: TokenBudget, chunks: list[ScheduledChunk], now: float) -> None:
        admitted: list[Request] = []
        for request in self.waiting:
            if budget.exhausted or len(self.running) + len(admitted) >= self._max_seqs:
                break
            chunk = self._chunk(request, budget)
            if chunk is None:
                if self.config.skip_blocked:
                    continue
                break
            admitted.append(request)
            chunks.append(chunk)
        if admitted:
            self.waiting.remove(admitted)
            for request in admitted:
                request.admit(now)
            self.running.extend(admitted)
