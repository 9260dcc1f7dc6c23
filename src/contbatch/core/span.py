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

Equivalence (tested against step-by-step simulation on thousands of random traces and
configurations, under every cost model): the steps a run takes give the same per-request
timelines, finish reasons, step ids, counters and KV usage as that many `schedule`/`update`
calls. A run refuses a step (`decode_segment` / `admit_step` return None and change nothing)
whenever it could involve a decision: a KV shortage (someone would be preempted), or an arrival
that does not fit at once (then it stays waiting and the scheduler decides). Runs only start
under `may_run`: engine semantics, no speculative decoding, output credits, timeouts, prefix
caching or estimate admission, nothing waiting, and every running request steadily decoding;
they admit arrivals only without tenant quotas, fair-share accounting or a waiting-queue bound.

Invariants while a run is open: each scheduler request is either a member or untouched; the
scheduler's `running` list is stale (refreshed by `close`), so nothing else may drive the
scheduler until `close`; `owed` >= 0 and pool free blocks - `owed` >= 0.
"""

from __future__ import annotations

import heapq
from collections.abc import MutableMapping
from dataclasses import dataclass

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput
from contbatch.core.request import Request
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.core.status import FinishReason

NEVER = 1 << 62  # a run step no run reaches


@dataclass(frozen=True, slots=True)
class Segment:
    """Coming steps that decode the same members, nothing else: step j (0-based) decodes
    `num_decodes` requests attending to `first_context + j * num_decodes` positions, padded by
    `num_padding` tokens, while `blocks_in_use[j]` KV blocks are in use (owed ones included)."""

    num_decodes: int
    first_context: int
    num_padding: int
    blocks_in_use: list[int]


@dataclass(slots=True, eq=False)
class _Member:
    """A running request inside a run. Run step i (0-based) is the run's (i + 1)-th step.

    - `first`: the step of its first token in the run (0 for requests running at the start; the
      prefill step for requests admitted in the run);
    - `last`: the step of its last token (it finishes at that step's end);
    - `base`: its computed tokens are `base + (steps done - first)` once it has run, so it
      attends to `base + i - first + 1` positions when it decodes at step i;
    - `grows_from`: the first step at which its context outgrows its blocks (then every
      `block_size` steps); NEVER when it never grows (reserved, or no KV limit);
    - `stops`: its last token is an executor stop (else the output limit ends it);
    - `owed_at_join`: blocks counted for it at admission but not taken from the pool (admitted
      in the run: its whole first allocation; 0 for requests that held their blocks before).
    """

    request: Request
    first: int
    last: int
    base: int
    grows_from: int
    stops: bool
    owed_at_join: int
    done: bool = False

    def owed_after(self, num_steps: int, block_size: int) -> int:
        """Blocks owed for it after the run's first `num_steps` steps: those counted at its
        admission plus those it grew into."""
        end = min(num_steps, self.last + 1)
        grown = 0 if end <= self.grows_from else (end - 1 - self.grows_from) // block_size + 1
        return self.owed_at_join + grown


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
    """See the module docstring. Use: `open_run`; then repeatedly either `decode_segment` (price
    its steps, take as many as you like with `commit_segment`) or, when requests arrive,
    `admit_step` (price the shape) and `commit`; finally `close()`."""

    def __init__(
        self, scheduler: ContinuousScheduler, stop_after: MutableMapping[str, int], *, admits_arrivals: bool
    ) -> None:
        self.scheduler = scheduler
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
        # the pool only changes in a run when a member that held blocks before it finishes
        self._num_blocks = memory.kv.num_blocks if memory is not None else 0
        self._pool_free = memory.kv.num_free_blocks if memory is not None else 0
        self._pending: tuple[list[Request], int] | None = None
        self._admitted_owed: list[int] = []  # per arrival of the planned step: blocks owed for it

    # -- joining and leaving -----------------------------------------------------------------
    def _join(self, request: Request, first: int, base: int, outputs_before: int, owed: int = 0) -> None:
        left = request.max_output_tokens - outputs_before
        stop = self.stop_after.get(request.request_id)
        stops = stop is not None and stop <= left
        last = first + (stop if stop is not None and stops else left) - 1
        # the first step whose context (base + i - first + 1) outgrows its blocks
        grows_from = request.kv_capacity + first - base if self.tracks_growth else NEVER
        member = _Member(request, first, last, base, grows_from, stops, owed)
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
    def decode_segment(self, max_steps: int) -> Segment | None:
        """The coming steps (at most `max_steps`) that decode the same members with nothing
        arriving: up to the next step at which a member finishes, while the pool gives every
        step's growth. None when there are none (no member, or the next step needs a
        preemption). Followed by `commit_segment` with the end times of the steps taken."""
        n = self.num_decoding
        if n == 0:
            return None
        i = len(self.step_ts)
        end = i + max_steps
        if self.finishing:
            end = min(end, self.finishing[0][0] + 1)
        used = self._num_blocks - self._pool_free + self.owed
        if not self.tracks_growth:
            in_use = [used] * (end - i)
        else:
            in_use = []
            free, phase, block_size = self._pool_free - self.owed, self.phase, self.block_size
            for t in range(i, end):
                growth = phase[t % block_size]
                if growth > free:
                    break  # someone must be preempted: the scheduler decides
                free -= growth
                used += growth
                in_use.append(used)
        if not in_use:
            return None
        return Segment(n, self.context_base + n * (i + 1), self.scheduler.bucket_padding_for(n), in_use)

    def commit_segment(self, segment: Segment, end_ts: list[float]) -> None:
        """Take the first `len(end_ts)` steps of `segment`, ending at those times."""
        k = len(end_ts)
        if not k:
            return
        i = len(self.step_ts)
        self.step_ts.extend(end_ts)
        self.owed = segment.blocks_in_use[k - 1] - (self._num_blocks - self._pool_free)
        self.num_padding_tokens += k * segment.num_padding
        self._finish_due(i + k - 1)

    def admit_step(self, now: float) -> tuple[SchedulerOutput, int] | None:
        """Plan the next step with every waiting request (arrivals just handed to the scheduler)
        admitted into it, in queue order, and prefilled whole: its full shape and the KV blocks
        in use while it runs. None when one of them does not fit at once or the step needs a
        preemption (nothing changed then: they stay waiting for the scheduler). Must be
        followed by `commit`."""
        if not self.admits_arrivals:
            return None
        i = len(self.step_ts)
        n = self.num_decoding
        growth = self.phase[i % self.block_size] if self.tracks_growth else 0
        waiting = list(self.scheduler.waiting.candidates(now))
        admitted = self._admissible(waiting, n, self._pool_free - self.owed - growth)
        if not admitted:
            return None
        self.owed += growth
        for request in admitted:
            blocks = self._admit(request, now)
            self.owed += blocks
            self._admitted_owed.append(blocks)
        prefill = sum(r.num_prompt_tokens for r in admitted)
        padding = self.scheduler.bucket_padding_for(n + prefill)
        self._pending = (admitted, padding)
        chunks = tuple(ScheduledChunk(r.request_id, 0, r.num_prompt_tokens, True, True) for r in admitted)
        context = self.context_base + n * (i + 1)
        shape = SchedulerOutput(
            self.first_step_id + i,
            chunks,
            prefill + n,
            prefill,
            n,
            prefill + context,
            padding,
            num_requests=len(chunks) + n,
            num_omitted_decodes=n,
        )
        return shape, self._num_blocks - self._pool_free + self.owed

    def _admissible(self, waiting: list[Request], n: int, free: int) -> list[Request]:
        """All of `waiting` when they fit this step at once, each with its whole prompt (a seat,
        the budget, their blocks); [] when one does not (then the scheduler decides)."""
        s = self.scheduler
        cfg = s.config
        memory = s.memory
        seats = s._max_seqs - self.num_alive
        budget = cfg.max_num_batched_tokens - n
        cap = cfg.max_prefill_tokens_per_request if cfg.chunked_prefill else None
        for k, request in enumerate(waiting):
            prompt = request.num_prompt_tokens
            if seats <= 0 or prompt > budget or (cap is not None and prompt > cap):
                return []
            if memory is not None:
                blocks = memory.kv.num_blocks_for(_first_hold(request, s))
                alone = n == 0 and k == 0  # nothing else runs: no watermark (Memory.admit)
                if blocks + (0 if alone else memory.watermark_blocks) > free:
                    return []
                free -= blocks
            seats -= 1
            budget -= prompt
        return waiting

    def _admit(self, request: Request, now: float) -> int:
        """Admit a waiting request checked by `_admissible`; returns the blocks owed for it
        (counted, not taken: it takes them from the pool only if it is still running at
        `close`)."""
        s = self.scheduler
        s.waiting.admitted(request)
        s.waiting.remove((request,))
        request.admit(now)
        if s.memory is None:
            return 0
        blocks = s.memory.kv.num_blocks_for(_first_hold(request, s))
        request.kv_capacity = blocks * self.block_size  # what it would hold (for its growth steps)
        return blocks

    def commit(self, end_ts: float) -> None:
        """Take the step planned by the last `admit_step`, ending at `end_ts`."""
        assert self._pending is not None, "commit without admit_step"
        admitted, padding = self._pending
        self._pending = None
        i = len(self.step_ts)
        self.step_ts.append(end_ts)
        self.num_padding_tokens += padding
        for request, owed in zip(admitted, self._admitted_owed, strict=True):
            self._join(request, i, request.num_prompt_tokens - 1, 0, owed)
        self._admitted_owed.clear()
        self._finish_due(i)

    def _finish_due(self, step: int) -> None:
        """Finish the members whose last token came at `step` (just taken)."""
        heap = self.finishing
        while heap and heap[0][0] == step:
            member = heapq.heappop(heap)[2]
            self._stop_decoding(member)
            self._finish(member, step + 1)

    def _finish(self, m: _Member, num_steps: int) -> None:
        self._materialize(m, num_steps)
        m.done = True
        self.num_alive -= 1
        reason = FinishReason.STOP if m.stops else FinishReason.LENGTH
        self.scheduler._finish(m.request, reason, self.step_ts[m.last])  # frees the blocks it really holds
        if self.scheduler.memory is not None:
            self._pool_free = self.scheduler.memory.kv.num_free_blocks

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
            if self.scheduler._charges_service:
                self.scheduler.waiting.charge(r, len(ts))
            rid = r.request_id
            if rid in self.stop_after:
                self.stop_after[rid] -= len(ts)
        self.owed -= m.owed_after(num_steps, self.block_size)

    def _take_blocks(self, m: _Member) -> bool:
        """Take from the pool what a member still running holds (its owed blocks)."""
        memory = self.scheduler.memory
        assert memory is not None
        r = m.request
        if not m.owed_at_join:  # held its blocks before the run: only the growth is new
            return memory.grow(r, r.num_computed_tokens)
        r.kv_capacity = 0  # it held nothing in the pool yet
        return memory.reserve(r, max(_first_hold(r, self.scheduler), r.num_computed_tokens))

    def close(self) -> list[Request]:
        """Hand the state back to the scheduler as if every step had been scheduled one by one:
        members' requests updated, their blocks taken, `running` refreshed. Returns the
        requests still running."""
        s = self.scheduler
        k = len(self.step_ts)
        running: list[Request] = []
        for m in self.members:
            if m.done:
                continue
            self._materialize(m, k)
            running.append(m.request)
        if s.memory is not None:
            for m in self.members:
                if not m.done and not self._take_blocks(m):
                    raise AssertionError(f"decode run: no block for {m.request.request_id!r} it was counted to hold")
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


def _first_hold(request: Request, s: ContinuousScheduler) -> int:
    """Tokens a new request's first allocation covers (`Memory._hold` of a whole prompt)."""
    assert s.memory is not None
    reserve = s.memory.config.admission == "reserve"
    return request.num_prompt_tokens + request.max_output_tokens if reserve else request.num_prompt_tokens


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
