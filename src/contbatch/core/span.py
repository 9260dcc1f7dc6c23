"""Decode runs: many steps whose every decision is foregone, taken at O(events) cost (the
simulator's skip-ahead).

While every running request decodes one token per step, nothing waits and nothing can go
wrong, each step is fully determined: every running request gets its token, the batch shrinks
as requests finish, the KV pool gives each request its next block at a block boundary, and an
arriving request that fits (a seat, its whole prompt in the token budget, its blocks above the
watermark) is admitted and prefilled at once. A `DecodeRun` takes such steps without touching
the requests one by one: its members are implicit (each is described by the run step of its
first token, its last step and its computed tokens at that point), a step costs O(1) plus its
arrivals and completions, and the KV blocks members grow into are only counted (`owed`) until
the run closes (or the member finishes), which keeps the pool's free count exact for every
decision taken meanwhile.

Equivalence (tested against step-by-step simulation on hundreds of random traces): the steps a
run takes give the same per-request timelines, finish reasons, step ids, counters and KV usage
as that many `schedule`/`update` calls. A run refuses a step (`next_step` returns None and
changes nothing) whenever it could involve a decision: a KV shortage (someone would be
preempted), an arrival that does not fit at once, or more than one arrival under a queue order
that is not first come first served. Runs only start under `may_run`: engine semantics, no
speculative decoding, output credits, timeouts, prefix caching or estimate admission, nothing
waiting, and every running request steadily decoding.

Invariants while a run is open: each scheduler request is either a member or untouched; the
scheduler's `running` list is stale (refreshed by `close`), so nothing else may drive the
scheduler until `close`; `owed` >= 0 and pool free blocks - `owed` >= 0.
"""

from __future__ import annotations

import heapq
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.core.queue import WaitingQueue
from contbatch.core.request import Request
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.core.status import FinishReason

NEVER = 1 << 62  # a run step no run reaches


@dataclass(slots=True, eq=False)
class _Member:
    """A running request inside a run. Run step i (0-based) is the run's (i + 1)-th step.

    - `first`: the step of its first token in the run (0 for requests running at the start; the
      prefill step for requests admitted in the run);
    - `last`: the step of its last token (it finishes at that step's end; NEVER when it never
      finishes by itself);
    - `base`: its computed tokens are `base + (steps done - first)` once it has run, so it
      attends to `base + i - first + 1` positions when it decodes at step i;
    - `grows_from`: the first step at which its context outgrows its blocks (then every
      `block_size` steps); NEVER when it never grows (reserved, or no KV limit);
    - `stops`: its last token is an executor stop (else the output limit ends it).
    """

    request: Request
    first: int
    last: int
    base: int
    grows_from: int
    stops: bool
    done: bool = False

    def growths_before(self, step: int, block_size: int) -> int:
        """Blocks it has grown into during steps [first, step)."""
        end = min(step, self.last + 1)
        return 0 if end <= self.grows_from else (end - 1 - self.grows_from) // block_size + 1


def may_run(s: ContinuousScheduler) -> bool:
    """Cheap pre-check (O(1)): could the next steps form a decode run at all?"""
    cfg = s.config
    memory = s.memory
    return bool(s.running) and not (
        s.waiting
        or not cfg.sample_on_prefill
        or cfg.num_speculative_tokens
        or cfg.lifecycle.output_credits is not None
        or cfg.lifecycle.has_timeouts
        or len(s.running) > cfg.max_num_batched_tokens
        or (memory is not None and (memory.config.enable_prefix_caching or memory.config.admission == "estimate"))
    )


class DecodeRun:
    """See the module docstring. Use: `open_run`, then per step `next_step(arrivals)` (price the
    returned shape), `commit(end_ts)`; finally `close()`."""

    def __init__(
        self, scheduler: ContinuousScheduler, stop_after: MutableMapping[str, int], *, admits_arrivals: bool
    ) -> None:
        self.s = scheduler
        self.first_step_id = scheduler._step_id  # the id of the run's first step
        self.stop_after = stop_after  # the executor's stop countdowns: decremented at close
        self.admits_arrivals = admits_arrivals and _admission_is_simple(scheduler)
        memory = scheduler.memory
        self.tracks_growth = memory is not None and memory.config.admission != "reserve"
        self.block_size = memory.kv.block_size if memory is not None else 1
        self.members: list[_Member] = []
        self.finishing: list[tuple[int, int, _Member]] = []  # (last step, order, member): a heap
        self.phase = [0] * self.block_size  # decoding members that grow at steps i with i % bs == key
        self.step_ts: list[float] = []  # end time of every step taken
        self.num_decoding = 0  # members decoding in the next step
        self.context_base = 0  # sum over decoding members of (base - first)
        self.num_alive = 0  # members not finished
        self.owed = 0  # blocks grown into by members, not yet taken from the pool
        self.num_padding_tokens = 0
        self._pending: tuple[list[tuple[Request, ScheduledChunk]], int, int] | None = None

    # -- joining and leaving -----------------------------------------------------------------
    def _join(self, request: Request, first: int, base: int, outputs_before: int) -> None:
        left = request.max_output_tokens - outputs_before
        stop = self.stop_after.get(request.request_id)
        stops = stop is not None and stop <= left
        last = first + (stop if stop is not None and stops else left) - 1
        # the first step whose context (base + i - first + 1) outgrows its blocks
        grows_from = request.kv_capacity + first - base if self.tracks_growth else NEVER
        member = _Member(request, first, last, base, grows_from, stops)
        self.members.append(member)
        self.num_alive += 1
        heapq.heappush(self.finishing, (last, len(self.members), member))
        self._start_decoding(member)

    def _start_decoding(self, m: _Member) -> None:
        self.num_decoding += 1
        self.context_base += m.base - m.first
        if m.grows_from < NEVER:
            self.phase[m.grows_from % self.block_size] += 1

    def _stop_decoding(self, m: _Member) -> None:
        self.num_decoding -= 1
        self.context_base -= m.base - m.first
        if m.grows_from < NEVER:
            self.phase[m.grows_from % self.block_size] -= 1

    # -- the steps ----------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.step_ts)

    def usage_blocks(self) -> int:
        """KV blocks in use now (during a planned step: by it), owed ones included (0 without a
        KV limit)."""
        memory = self.s.memory
        return memory.kv.num_used_blocks + self.owed if memory is not None else 0

    def next_step(self, arrivals: Sequence[Request], now: float) -> tuple[int, int, int, SchedulerOutput | None] | None:
        """Plan the next step, admitting `arrivals` (due by `now`, not yet handed to the
        scheduler) into it. Returns (decodes, context positions they attend to, padding tokens,
        the full step shape when the step also prefills arrivals, else None), or None when the
        step is not the run's to take (nothing changed then). Must be followed by `commit`."""
        i = len(self.step_ts)
        n = self.num_decoding
        growth = self.phase[i % self.block_size] if self.tracks_growth else 0
        memory = self.s.memory
        free = memory.kv.num_free_blocks - self.owed - growth if memory is not None else 0
        if growth and free < 0:
            return None  # someone must be preempted: the scheduler decides
        context = self.context_base + n * (i + 1)
        admitted: list[tuple[Request, ScheduledChunk]] = []
        if arrivals:
            if not self.admits_arrivals or (len(arrivals) > 1 and type(self.s.waiting) is not WaitingQueue):
                return None
            admitted = self._admissible(arrivals, n, free)
            if not admitted:
                return None
        elif n == 0:
            return None
        prefill = sum(chunk.num_new_tokens for _, chunk in admitted)
        padding = self.s.bucket_padding_for(n + prefill)
        self._pending = (admitted, growth, padding)
        self.owed += growth
        if not admitted:
            return n, context, padding, None
        for request, chunk in admitted:
            self._admit(request, chunk, now, alone=n == 0 and chunk is admitted[0][1])
        chunks = [chunk for _, chunk in admitted]
        shape = build_output(self.first_step_id + i, chunks, num_padding_tokens=padding)
        return n, context, padding, _with_decodes(shape, n, context)

    def _admissible(self, arrivals: Sequence[Request], n: int, free: int) -> list[tuple[Request, ScheduledChunk]]:
        """Each arrival with its whole-prompt chunk when all of them fit this step at once (a
        seat, the budget, their blocks); [] when one does not (then the scheduler decides)."""
        s = self.s
        cfg = s.config
        memory = s.memory
        seats = s._max_seqs - self.num_alive
        budget = cfg.max_num_batched_tokens - n
        admitted: list[tuple[Request, ScheduledChunk]] = []
        for request in arrivals:
            prompt = request.num_prompt_tokens
            cap = cfg.max_prefill_tokens_per_request
            if seats <= 0 or prompt > budget or (cfg.chunked_prefill and cap is not None and prompt > cap):
                return []
            if s.rejection(request)[1] or cfg.lifecycle.max_waiting is not None:
                return []
            if memory is not None:
                hold = prompt + request.max_output_tokens if memory.config.admission == "reserve" else prompt
                alone = n == 0 and not admitted
                need = memory.kv.num_blocks_for(hold) + (0 if alone else memory.watermark_blocks)
                if need > free:
                    return []
                free -= memory.kv.num_blocks_for(hold)
            seats -= 1
            budget -= prompt
            admitted.append((request, ScheduledChunk(request.request_id, 0, prompt, True, True)))
        return admitted

    def _admit(self, request: Request, chunk: ScheduledChunk, now: float, *, alone: bool) -> None:
        s = self.s
        s.add_request(request, now)
        if s.memory is not None and s.memory.admit(request, chunk, alone=alone) is None:
            raise AssertionError(f"decode run: {request.request_id!r} was checked to fit")
        s.waiting.admitted(request)
        s.waiting.remove((request,))
        request.admit(now)

    def abandon(self) -> None:
        """Do not take the step planned by the last `next_step` (one that admitted nobody)."""
        assert self._pending is not None and not self._pending[0], "only a step without admissions can be abandoned"
        self.owed -= self._pending[1]
        self._pending = None

    def commit(self, end_ts: float) -> list[Request]:
        """Take the step planned by the last `next_step`, ending at `end_ts`; returns the
        requests it finished."""
        assert self._pending is not None, "commit without next_step"
        admitted, _growth, padding = self._pending
        self._pending = None
        i = len(self.step_ts)
        self.step_ts.append(end_ts)
        self.num_padding_tokens += padding
        for request, _chunk in admitted:
            self._join(request, i, request.num_prompt_tokens - 1, 0)
        done: list[Request] = []
        heap = self.finishing
        while heap and heap[0][0] == i:
            member = heapq.heappop(heap)[2]
            self._stop_decoding(member)
            self._finish(member, i + 1)
            done.append(member.request)
        return done

    def _finish(self, m: _Member, num_steps: int) -> None:
        self._materialize(m, num_steps)
        m.done = True
        self.num_alive -= 1
        reason = FinishReason.STOP if m.stops else FinishReason.LENGTH
        self.s._finish(m.request, reason, self.step_ts[m.last])  # frees the blocks it really holds

    def _materialize(self, m: _Member, num_steps: int) -> None:
        """Bring the member's request up to date after `num_steps` run steps: tokens, computed
        tokens, its owed blocks (released here; re-taken by the caller if it keeps running)."""
        r = m.request
        end = min(num_steps, m.last + 1)
        if end > m.first:
            ts = self.step_ts[m.first : end]
            r.output_token_ids.extend([0] * len(ts))
            r.num_output_tokens += len(ts)
            r.timeline.record_token_run(ts)
            r.num_computed_tokens = m.base + end - m.first
            if self.s._charges_service:
                self.s.waiting.charge(r, len(ts))
            rid = r.request_id
            if rid in self.stop_after:
                self.stop_after[rid] -= len(ts)
        if m.grows_from < NEVER:
            self.owed -= m.growths_before(num_steps, self.block_size)

    def close(self) -> list[Request]:
        """Hand the state back to the scheduler as if every step had been scheduled one by one:
        members' requests updated, their blocks taken, `running` refreshed. Returns the
        requests still running."""
        s = self.s
        k = len(self.step_ts)
        running: list[Request] = []
        for m in self.members:
            if m.done:
                continue
            self._materialize(m, k)
            running.append(m.request)
        if s.memory is not None:
            for request in running:
                if not s.memory.grow(request, request.num_computed_tokens):
                    raise AssertionError(f"decode run: no block for {request.request_id!r} it was counted to hold")
            ratio_floor = s.memory.config.estimate_min_ratio
            for _ in range(k):
                if s.memory.ratio == ratio_floor:
                    break
                s.memory.end_step(preempted=False)
        assert self.owed == 0, f"decode run closed with {self.owed} blocks owed"
        s.running = running
        s._step_id += k
        s.stats.num_bucket_padding_tokens += self.num_padding_tokens
        return running


def open_run(
    scheduler: ContinuousScheduler, stop_after: MutableMapping[str, int], *, admits_arrivals: bool
) -> DecodeRun | None:
    """A run starting from the scheduler's current state, or None when a running request is not
    steadily decoding or holds more blocks than its next token needs (`may_run` must hold)."""
    run = DecodeRun(scheduler, stop_after, admits_arrivals=admits_arrivals)
    for r in scheduler.running:
        computed = r.num_computed_tokens
        if computed != r.num_known_tokens - 1 or computed < r.num_prompt_tokens:
            return None
        if run.tracks_growth and not 0 <= r.kv_capacity - computed < run.block_size:
            return None
    for r in scheduler.running:
        run._join(r, 0, r.num_computed_tokens, r.num_output_tokens)
    return run


def _admission_is_simple(s: ContinuousScheduler) -> bool:
    """Arrivals may be admitted inside a run only when admitting one that fits involves no
    choice: no tenant quotas, no fair-share accounting, no bound on the waiting queue."""
    tenants = s.config.tenants
    return (
        tenants.max_running is None
        and tenants.max_kv_blocks is None
        and not s._charges_service
        and s.config.lifecycle.max_waiting is None
    )


def _with_decodes(shape: SchedulerOutput, num_decodes: int, context: int) -> SchedulerOutput:
    """`shape` (the step's prefill chunks) plus `num_decodes` steady decodes left out of its
    chunks, attending to `context` positions in all."""
    return SchedulerOutput(
        shape.step_id,
        shape.chunks,
        shape.num_batched_tokens + num_decodes,
        shape.num_prefill_tokens,
        shape.num_decode_tokens + num_decodes,
        shape.num_context_tokens + context,
        shape.num_padding_tokens,
        num_requests=len(shape.chunks) + num_decodes,
        num_omitted_decodes=num_decodes,
    )
