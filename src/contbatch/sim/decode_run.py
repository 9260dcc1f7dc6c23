"""Decode runs: many simulator steps whose every decision is foregone, taken at O(events) cost
(the simulator's skip-ahead), through the scheduler's public fast-forward API
(`contbatch.core.fastforward`: it answers the admission rules and makes the state changes).

While every running request decodes one token per step and nothing waits, each step is fully
determined (see `contbatch.core.fastforward`). A `DecodeRun` takes such steps without touching
the requests one by one: its members are implicit (each is described by the run step of its
first token, its last step and its computed tokens at that point), a step costs O(1) plus its
arrivals and completions, and the KV blocks members grow into are only counted (`owed`) until
the run closes (or the member finishes), which keeps the pool's free count exact for every
decision taken meanwhile.

Equivalence (tested against step-by-step simulation on thousands of random traces and
configurations, under every cost model): the steps a run takes give the same per-request
timelines, finish reasons, step ids, counters, KV usage and per-step records as that many
`schedule`/`update` calls. A run refuses a step (`decode_segment` / `admit_step` return None and
change nothing) whenever it could involve a decision: a KV shortage (someone would be
preempted), or an arrival that does not fit at once (then it stays waiting and the scheduler
decides).

Invariants while a run is open: each scheduler request is either a member or untouched; the
scheduler's running set is stale (refreshed by `close`), so nothing else may drive the
scheduler until `close`; `owed` >= 0 and pool free blocks - `owed` >= 0.
"""

from __future__ import annotations

import heapq
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import NamedTuple

from contbatch.core.fastforward import FastForward
from contbatch.core.outputs import ScheduledChunk, SchedulerOutput
from contbatch.core.request import Request
from contbatch.core.status import FinishReason

NEVER = 1 << 62  # a run step no run reaches


class Segment(NamedTuple):
    """Coming steps that decode the same members, nothing else: step j (0-based) decodes
    `num_decodes` requests attending to `first_context + j * num_decodes` positions, padded by
    `num_padding` tokens, while `blocks_in_use[j]` KV blocks are in use (owed ones included).
    (A named tuple: one is made per stretch between two events, so it must be cheap to make.)"""

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


class DecodeRun:
    """See the module docstring. Use: `open_run`; then repeatedly either `decode_segment` (price
    its steps, take as many as you like with `commit_segment`) or, when requests arrive,
    `admit_step` (price the shape) and `commit`; finally `close()`."""

    def __init__(self, ff: FastForward, stop_after: MutableMapping[str, int], *, admits_arrivals: bool) -> None:
        self.ff = ff
        self.first_step_id = ff.first_step_id  # the id of the run's first step
        self.stop_after = stop_after  # the executor's stop countdowns: decremented at close
        self.admits_arrivals = admits_arrivals and ff.admits_arrivals
        self.tracks_growth = ff.tracks_growth
        self.block_size = ff.block_size
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
        self._num_blocks = ff.num_blocks
        self._pool_free = ff.num_free_blocks()
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
        in_use = self._blocks_in_use(i, end, used) if self.tracks_growth else [used] * (end - i)
        if not in_use:
            return None
        return Segment(n, self.context_base + n * (i + 1), self.ff.bucket_padding(n), in_use)

    def _blocks_in_use(self, i: int, end: int, used: int) -> list[int]:
        """Blocks in use during steps i, i + 1, ... < `end` as members grow (`used` before step
        i), up to the first step whose growth the pool cannot give (someone must be preempted
        then: the scheduler decides)."""
        in_use: list[int] = []
        append = in_use.append
        free, phase, block_size = self._pool_free - self.owed, self.phase, self.block_size
        for t in range(i, end):
            growth = phase[t % block_size]
            if growth > free:
                break
            free -= growth
            used += growth
            append(used)
        return in_use

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
        waiting = self.ff.waiting(now)
        owed = self._admissible(waiting, n, self._pool_free - self.owed - growth) if waiting else None
        if owed is None:
            return None
        self.owed += growth
        for request, blocks in zip(waiting, owed, strict=True):
            self.ff.admit(request, now, blocks)
            self.owed += blocks
        self._admitted_owed = owed
        samples = self.ff.samples_on_prefill
        chunks = tuple([ScheduledChunk(r.request_id, 0, r.num_prompt_tokens, True, samples) for r in waiting])
        prefill = sum([c.num_new_tokens for c in chunks])
        padding = self.ff.bucket_padding(n + prefill)
        self._pending = (waiting, padding)
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

    def _admissible(self, waiting: list[Request], n: int, free: int) -> list[int] | None:
        """The blocks each of `waiting` takes when all of them fit this step at once, each with its
        whole prompt (a seat, the budget, their blocks), asked of the scheduler's own rules one
        after the other; None when one does not."""
        ff = self.ff
        running, budget = self.num_alive, ff.max_num_batched_tokens - n
        owed: list[int] = []
        for k, request in enumerate(waiting):
            alone = n == 0 and k == 0  # nothing else runs: no watermark
            blocks = ff.fits_whole(request, num_running=running, budget=budget, free_blocks=free, alone=alone)
            if blocks is None:
                return None
            owed.append(blocks)
            free -= blocks
            running += 1
            budget -= request.num_prompt_tokens
        return owed

    def commit(self, end_ts: float) -> None:
        """Take the step planned by the last `admit_step`, ending at `end_ts`."""
        assert self._pending is not None, "commit without admit_step"
        admitted, padding = self._pending
        self._pending = None
        i = len(self.step_ts)
        self.step_ts.append(end_ts)
        self.num_padding_tokens += padding
        for request, owed in zip(admitted, self._admitted_owed, strict=True):
            if self.ff.samples_on_prefill:  # its prefill step sampled its first token
                self._join(request, i, request.num_prompt_tokens - 1, 0, owed)
            else:  # the seed's semantics: its first token comes from the next step's decode unit
                self._join(request, i + 1, request.num_prompt_tokens, 0, owed)
        self._admitted_owed = []
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
        self._pool_free = self.ff.finish(m.request, reason, self.step_ts[m.last])  # frees what it really holds

    def _materialize(self, m: _Member, num_steps: int) -> None:
        """Bring the member's request up to date after `num_steps` run steps: tokens, computed
        tokens, its owed blocks (released here; re-taken by the caller if it keeps running)."""
        r = m.request
        end = min(num_steps, m.last + 1)
        if end > m.first:
            ts = self.step_ts[m.first : end]
            self.ff.emit(r, ts, m.base + end - m.first)
            rid = r.request_id
            if rid in self.stop_after:
                self.stop_after[rid] -= len(ts)
        elif r.num_computed_tokens != m.base:  # prefilled in the run, no token yet (the seed's semantics)
            self.ff.emit(r, [], m.base)
        self.owed -= m.owed_after(num_steps, self.block_size)

    def close(self) -> list[Request]:
        """Hand the state back to the scheduler as if every step had been scheduled one by one:
        members' requests updated, their blocks taken, the running set refreshed. Returns the
        requests still running."""
        k = len(self.step_ts)
        running: list[Request] = []
        for m in self.members:
            if m.done:
                continue
            self._materialize(m, k)
            running.append(m.request)
        if self._num_blocks:
            for m in self.members:
                if not m.done and not self.ff.take_blocks(m.request, held_before=not m.owed_at_join):
                    raise AssertionError(f"decode run: no block for {m.request.request_id!r} it was counted to hold")
        assert self.owed == 0, f"decode run closed with {self.owed} blocks owed"
        self.ff.close(running, num_steps=k, num_padding_tokens=self.num_padding_tokens)
        return running


def open_run(ff: FastForward, stop_after: MutableMapping[str, int], *, admits_arrivals: bool) -> DecodeRun:
    """A run starting from the scheduler's state when `ff` was obtained."""
    run = DecodeRun(ff, stop_after, admits_arrivals=admits_arrivals)
    for r in ff.running:
        run._join(r, 0, r.num_computed_tokens, r.num_output_tokens)
    return run
