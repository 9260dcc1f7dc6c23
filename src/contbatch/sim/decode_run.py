"""Decode runs: many simulator steps whose every decision is foregone, taken at O(events) cost
(the simulator's skip-ahead), through the scheduler's public fast-forward API
(`contbatch.core.fastforward`: it answers the admission rules and makes the state changes).

While every running request decodes one token per step (but the newest, perhaps, computing its
prompt in chunks), each step is determined by the scheduler's rules (see
`contbatch.core.fastforward`). A `DecodeRun` takes such steps without touching the running
requests one by one: its members are implicit (each is described by the run step of its first
token, its last step and its computed tokens at that point), a step costs O(1) plus its
admissions and completions, and the KV blocks members grow into are only counted (`owed`) until
the run closes (or the member finishes), which keeps the pool's free count exact for every
decision taken meanwhile. While nothing waits and nobody is prefilling, steps come in segments of
steady decodes (`decode_segment`); otherwise each step is planned whole (`plan_step`): the
decodes, the prefilling member's next chunk (what the budget leaves), then the waiting requests in
queue order, each admitted with its first chunk while it fits (a partial one becomes the
prefilling member), as `schedule` would. A step in which a running request cannot grow is
planned whole too (`FastForward.victim_index`, `preempt`): the victims the KV config's rule picks
(`_Shortage`) leave the run with their tokens materialized and go to the front of the queue
(`_plan_preempting`), to be admitted again inside the run: by recompute, or by swap, their
blocks taken from the pool and moved to host memory when the step is taken, and moved back when
a step admits them (`FastForward.swap_in`, blocks taken from the pool at once). A step that may
swap is priced from the shape `take` returns (the swaps' block ids exist only then). With prefix
caching every block counted is taken before any block returns to the pool (`_take_owed`), a
request's blocks are cached when it leaves (`FastForward.finish`, `preempt`) or at close, and a
step that would preempt is the scheduler's (see `contbatch.core.fastforward`).

Equivalence (tested against step-by-step simulation on thousands of random traces and
configurations, under every cost model): the steps a run takes give the same per-request
timelines, finish reasons, step ids, counters, KV usage and per-step records as that many
`schedule`/`update` calls. A run refuses a step (`decode_segment` / `plan_step` return None and
change nothing) whenever it could involve a decision it does not take: a waiting request whose
KV arrives from elsewhere (the scheduler brings it in), an admission the prefix cache could
decide (`FastForward.admits`), an empty step.

Invariants while a run is open: each scheduler request is either a member, the prefilling
member, or untouched; the scheduler's running set is stale (refreshed by `close`), so nothing else
may drive the scheduler until `close`; `owed` >= 0 and pool free blocks - `owed` >= 0; at most
one member is prefilling, and it is the newest.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, MutableMapping
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
    - `owed_at_join`: blocks counted for it when it started decoding but not taken from the pool
      (admitted in the run: its first allocation and what it grew into while prefilling; 0 for
      requests that decoded before the run);
    - `done`: it finished inside the run (its tokens are materialized).
    """

    __slots__ = ("base", "done", "first", "grows_from", "last", "owed_at_join", "request", "stops")

    def __init__(  # noqa: PLR0917 (one positional call site, in field order)
        self, request: Request, first: int, last: int, base: int, grows_from: int, stops: bool, owed_at_join: int
    ) -> None:
        self.request = request
        self.first = first
        self.last = last
        self.base = base
        self.grows_from = grows_from
        self.stops = stops
        self.owed_at_join = owed_at_join
        self.done = False

    def owed_after(self, num_steps: int, block_size: int) -> int:
        """Blocks owed for it after the run's first `num_steps` steps: those counted at its
        admission plus those it grew into."""
        end = min(num_steps, self.last + 1)
        grown = 0 if end <= self.grows_from else (end - 1 - self.grows_from) // block_size + 1
        return self.owed_at_join + grown


class _Prefill:
    """The member computing what it knows in chunks (its prompt; after a recompute preemption,
    its outputs too), the newest running: `done` tokens computed, `blocks` held (counted; those
    held in the pool before the run included), `owed` of them not taken from the pool."""

    __slots__ = ("blocks", "done", "owed", "request")

    def __init__(self, request: Request, done: int, blocks: int, owed: int) -> None:
        self.request = request
        self.done = done
        self.blocks = blocks
        self.owed = owed


class _Planned:
    """A step `plan_step` planned: its shape, the KV blocks in use while it runs, the decoding
    members' growth, the prefilling member's chunk and growth, the waiting requests it admits
    (each with its first chunk and first blocks), in queue order, and the running ones it
    preempts, in the order the scheduler preempts them. Read only."""

    __slots__ = ("admitted", "growth", "prefill_chunk", "prefill_growth", "shape", "swaps", "used", "victims")

    def __init__(  # noqa: PLR0917 (one positional call site, in field order)
        self,
        shape: SchedulerOutput,
        used: int,
        growth: int,
        prefill_chunk: ScheduledChunk | None,
        prefill_growth: int,
        admitted: list[tuple[Request, ScheduledChunk, int]],
        victims: tuple[_Member | _Prefill, ...] = (),
        swaps: bool = False,
    ) -> None:
        self.shape = shape
        self.used = used
        self.growth = growth
        self.prefill_chunk = prefill_chunk
        self.prefill_growth = prefill_growth
        self.admitted = admitted
        self.victims = victims
        self.swaps = swaps  # it may move blocks to or from host memory: its shape is `take`'s


class DecodeRun:
    """See the module docstring. Use: `open_run`; then repeatedly, while `needs_planning()`,
    `plan_step` (price the shape), `take` (at the step's start) and `commit` (at its end); else
    `decode_segment` (price its steps, take as many as you like with `commit_segment`); finally
    `close()`."""

    def __init__(self, ff: FastForward, stop_after: MutableMapping[str, int], *, admits_arrivals: bool) -> None:
        self.ff = ff
        self.first_step_id = ff.first_step_id  # the id of the run's first step
        self.stop_after = stop_after  # the executor's stop countdowns: decremented at close
        self.admits_arrivals = admits_arrivals and ff.admits_arrivals
        self.tracks_growth = ff.tracks_growth
        self.block_size = ff.block_size
        self.members: list[_Member] = []  # in running order (finished ones dropped by `_take_owed`)
        self.num_joined = 0  # members joined so far (the finishing heap's tie-break: running order)
        self.finishing: list[tuple[int, int, _Member]] = []  # (last step, order, member): a heap
        self.phase = [0] * self.block_size  # decoding members that grow at steps i with i % bs == key
        self.step_ts: list[float] = []  # end time of every step taken
        self.num_decoding = 0  # members decoding in the next step
        self.context_base = 0  # sum over decoding members of (base - first)
        self.num_alive = 0  # decoding members not finished (the prefilling one is apart)
        self.owed = 0  # blocks grown into by members, not yet taken from the pool
        self.num_padding_tokens = 0
        # the pool only changes in a run when a member that held blocks before it finishes
        self._num_blocks = ff.num_blocks
        self._pool_free = ff.num_free_blocks()
        self.prefill: _Prefill | None = None
        self._taken: _Planned | None = None  # the step taken, until its commit
        self._joining: list[tuple[_Prefill, ScheduledChunk]] = []  # its admissions, with their first chunks

    @property
    def num_running(self) -> int:
        """Running requests: the members not finished, the prefilling one, those the step taken
        admits."""
        taken = len(self._taken.admitted) if self._taken is not None else 0
        return self.num_alive + (self.prefill is not None) + taken

    def needs_planning(self) -> bool:
        """The next step is planned whole (`plan_step`), not as a decode segment: a member is
        prefilling or requests wait."""
        return self.prefill is not None or self.ff.has_waiting()

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
        self.num_joined += 1
        heapq.heappush(self.finishing, (last, self.num_joined, member))
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
        preemption). Followed by `commit_segment` with the end times of the steps taken. Only
        for steps that start while `needs_planning()` is False (a segment's steps admit nothing;
        a request arriving meanwhile waits for the next step boundary)."""
        n = self.num_decoding
        if n == 0:
            return None
        i = len(self.step_ts)
        end = i + max_steps
        self._drop_preempted()
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

    def plan_step(self, now: float) -> _Planned | None:
        """Plan the next step whole, as `schedule` at `now` would: every decoding member's token,
        the prefilling member's next chunk, then the waiting requests admitted while they fit.
        None when it needs a decision the run does not take (a waiting request the run does not
        admit (`FastForward.admits`), admitting when the run does not admit, an empty step).
        Changes nothing; followed by `take` and `commit`, or dropped. The shape is the step's but
        for its swaps (`_Planned.swaps`: `take` gives it whole)."""
        ff = self.ff
        i = len(self.step_ts)
        n = self.num_decoding
        growth = self.phase[i % self.block_size] if self.tracks_growth else 0
        free = self._pool_free - self.owed - growth
        if free < 0:
            return self._plan_preempting(i)  # a decoding member cannot grow: someone is preempted
        budget = ff.max_num_batched_tokens - n
        prefill_chunk, prefill_growth = None, 0
        pf = self.prefill
        if pf is not None:
            prefill_chunk = ff.plan(pf.request, budget) if budget > 0 else None
            if prefill_chunk is None:
                return None
            prefill_growth = max(ff.blocks_for(prefill_chunk.start + prefill_chunk.num_new_tokens) - pf.blocks, 0)
            if prefill_growth > free:
                return self._plan_preempting(i)  # the prefilling member cannot grow: someone is preempted
            free -= prefill_growth
            budget -= prefill_chunk.num_new_tokens
        admitted = self._admissions(now, budget, free) if ff.has_waiting() else []
        if admitted is None or (n == 0 and pf is None and not admitted):
            return None
        chunks = [prefill_chunk] if prefill_chunk is not None else []
        chunks += [chunk for _, chunk, _ in admitted]
        shape = self._step_shape(i, n, self.context_base, chunks)
        taken = growth + prefill_growth + sum([blocks for _, _, blocks in admitted])
        used = self._num_blocks - self._pool_free + self.owed + taken
        swaps = ff.swaps and any([ff.is_swapped(r) for r, _, _ in admitted])
        return _Planned(shape, used, growth, prefill_chunk, prefill_growth, admitted, swaps=swaps)

    def _plan_preempting(self, i: int) -> _Planned | None:
        """Step i when the pool cannot give what the running requests ask for, as the scheduler
        takes it (`_Shortage`); the step admits nobody. None when nothing would be left to run
        (the scheduler takes that step), and with prefix caching (a victim frees only the blocks
        no other request shares: the scheduler counts them)."""
        if self.ff.caches_prefixes:
            return None
        shortage = _Shortage(self, i)
        chunk, chunk_growth = shortage.decide()
        if not shortage.victims:
            return None  # (no shortage after all: not a step this plans)
        victims = shortage.victims
        decoding_victims = [v for v in victims if isinstance(v, _Member)]
        n = self.num_decoding - len(decoding_victims)
        chunks = [chunk] if chunk is not None else []
        if n == 0 and not chunks:
            return None
        context_base = self.context_base - sum([v.base - v.first for v in decoding_victims])
        ids = tuple([v.request.request_id for v in victims])
        shape = self._step_shape(i, n, context_base, chunks, ids)
        used = self._num_blocks - self._pool_free + self.owed - shortage.freed + shortage.growth + chunk_growth
        return _Planned(shape, used, shortage.growth, chunk, chunk_growth, [], tuple(victims), self.ff.swaps)

    def _step_shape(
        self, i: int, n: int, context_base: int, chunks: list[ScheduledChunk], preempted_ids: tuple[str, ...] = ()
    ) -> SchedulerOutput:
        """Step i's shape: `n` decoding members (their `context_base`, as `self.context_base`)
        and `chunks` (the prefilling member's, then the admitted ones')."""
        # a chunk that ends a recomputation (its last known position) is a decode, not a prefill
        tokens = sum([c.num_new_tokens for c in chunks])
        prefill = sum([c.num_new_tokens for c in chunks if c.is_prefill])
        context = context_base + n * (i + 1) + sum([c.start + c.num_new_tokens for c in chunks])
        return SchedulerOutput(
            self.first_step_id + i,
            tuple(chunks),
            tokens + n,
            prefill,
            tokens - prefill + n,
            context,
            self.ff.bucket_padding(n + tokens),
            preempted_ids=preempted_ids,
            num_requests=len(chunks) + n,
            num_omitted_decodes=n,
        )

    def _admissions(self, now: float, budget: int, free: int) -> list[tuple[Request, ScheduledChunk, int]] | None:
        """The waiting requests admitted with `budget` tokens and `free` blocks left, in queue
        order until one does not fit (each with its first chunk and blocks); None when one to
        decide about is not one the run admits, or the run does not admit, or, unless the
        admission phase is plain (`FastForward.plain_admission`), one is not admitted with its
        whole prompt."""
        ff = self.ff
        if not self.admits_arrivals:
            return None
        if not ff.plain_admission:
            return self._all_admitted_whole(now, budget, free)
        return self._admissions_plain(ff.waiting(now), budget, free)

    def _admissions_plain(
        self, waiting: Iterable[Request], budget: int, free: int
    ) -> list[tuple[Request, ScheduledChunk, int]] | None:
        """`_admissions` of a plain admission phase, offered `waiting` in order."""
        ff = self.ff
        running = self.num_running
        admitted: list[tuple[Request, ScheduledChunk, int]] = []
        for request in waiting:
            if budget <= 0:
                break
            if not ff.admits(request, [r for r, _, _ in admitted]):
                return None
            alone = running == 0 and not admitted  # nothing else runs: no watermark
            got = ff.admission(
                request, num_running=running + len(admitted), budget=budget, free_blocks=free, alone=alone
            )
            if got is None:
                break  # it blocks the queue
            chunk, blocks = got
            admitted.append((request, chunk, blocks))
            budget -= chunk.num_new_tokens
            free -= blocks
        return admitted

    def _all_admitted_whole(
        self, now: float, budget: int, free: int
    ) -> list[tuple[Request, ScheduledChunk, int]] | None:
        """`_admissions` when the admission phase is not plain: every waiting request, each with
        its whole prompt, or None."""
        waiting = list(self.ff.waiting(now))
        admitted = self._admissions_plain(waiting, budget, free)
        if admitted is None or len(admitted) < len(waiting):
            return None
        return admitted if all(c.num_new_tokens == r.num_prompt_tokens for r, c, _ in admitted) else None

    def take(self, planned: _Planned, now: float) -> SchedulerOutput:
        """Start the step `plan_step` planned, at `now`: its preemptions and admissions happen,
        its blocks are counted. Its shape, with the blocks its victims swapped out and its
        admissions swapped in. Followed by `commit`."""
        assert self._taken is None, "take twice without commit"
        ff = self.ff
        swapped_out, swapped_in = [], []
        for victim in planned.victims:
            moved = self._preempt(victim, now)
            if moved is not None:
                swapped_out.append((victim.request.request_id, moved))
        joining = self._joining
        for request, chunk, blocks in planned.admitted:
            if planned.swaps and ff.is_swapped(request):
                swapped_in.append((request.request_id, ff.swap_in(request, chunk, now)))
                joining.append((_Prefill(request, chunk.start, blocks, 0), chunk))
            else:
                ff.admit(request, now, blocks)
                self.owed += blocks
                joining.append((_Prefill(request, 0, blocks, blocks), chunk))
        if swapped_in:
            self._pool_free = ff.num_free_blocks()
        self.owed += planned.growth + planned.prefill_growth
        self._taken = planned
        if not (swapped_out or swapped_in):
            return planned.shape
        return dataclasses.replace(planned.shape, swapped_out=tuple(swapped_out), swapped_in=tuple(swapped_in))

    def commit(self, end_ts: float) -> None:
        """Take the step started by the last `take`, ending at `end_ts`."""
        planned = self._taken
        assert planned is not None, "commit without take"
        self._taken = None
        i = len(self.step_ts)
        self.step_ts.append(end_ts)
        self.num_padding_tokens += planned.shape.num_padding_tokens
        pf, chunk = self.prefill, planned.prefill_chunk
        if pf is not None and chunk is not None:
            pf.blocks += planned.prefill_growth
            pf.owed += planned.prefill_growth
            self.prefill = None
            self._prefilled(pf, chunk, i)
        for joined, first in self._joining:
            self._prefilled(joined, first, i)
        self._joining.clear()
        self._finish_due(i)

    def _prefilled(self, pf: _Prefill, chunk: ScheduledChunk, i: int) -> None:
        """`pf` computed `chunk` at step i: it goes on prefilling (the prefilling member), or,
        having computed all it knows, decodes from then on (its next token sampled by that step
        when the chunk samples, else, a prefill under the seed's semantics, by the next)."""
        r = pf.request
        self.ff.computed(r, chunk)
        pf.done = r.num_computed_tokens
        known = r.num_known_tokens
        if pf.done < known:
            assert self.prefill is None, "two members prefilling"
            self.prefill = pf
            return
        r.kv_capacity = pf.blocks * self.block_size  # counted ahead: `hold` takes them at close
        if chunk.samples:  # its token at this step (a prefill under engine semantics, or a swap-in's decode)
            self._join(r, i, pf.done - 1, r.num_output_tokens, pf.owed)
        else:  # the seed's semantics: a prefill samples nothing, the next step its first token
            self._join(r, i + 1, pf.done, r.num_output_tokens, pf.owed)

    def _preempt(self, victim: _Member | _Prefill, now: float) -> tuple[int, ...] | None:
        """Preempt `victim` at the start of the next step (at `now`): a member's tokens so far
        materialized, its counted blocks released (taken from the pool first when it swaps: the
        swap moves what it holds), the request to the queue (`FastForward.preempt`). The device
        blocks it swapped out, or None."""
        i = len(self.step_ts)
        self._take_owed(i)
        if isinstance(victim, _Prefill):
            self.prefill = None
            self.owed -= victim.owed
        else:
            self._stop_decoding(victim)
            self._materialize(victim, i)
            victim.done = True  # its `finishing` entry is dropped when it comes up
            self.num_alive -= 1
        ff, request = self.ff, victim.request
        if ff.swaps:  # (a swap moves what it holds)
            self._hold(request)
        moved = ff.preempt(request, now, i)
        self._pool_free = ff.num_free_blocks()
        return moved

    def _take_owed(self, num_steps: int) -> None:
        """With prefix caching, before blocks return to the pool: take every block owed after
        `num_steps` steps, as stepping took them before (blocks without a hash return to the
        free list's head, and a block taken from there instead of its tail would leave a hash
        cached that stepping evicted). Among themselves the order of takes changes nothing."""
        if not self.ff.caches_prefixes:
            return
        ff, block_size = self.ff, self.block_size
        self.members = [m for m in self.members if not m.done]  # (in running order still)
        for m in self.members:
            owed = m.owed_after(num_steps, block_size)
            if owed:
                ff.take_owed(m.request, owed)
                m.owed_at_join -= owed
                self.owed -= owed
        pf = self.prefill
        if pf is not None and pf.owed:
            ff.take_owed(pf.request, pf.owed)
            self.owed -= pf.owed
            pf.owed = 0
        self._pool_free = ff.num_free_blocks()

    def _drop_preempted(self) -> None:
        heap = self.finishing
        while heap and heap[0][2].done:
            heapq.heappop(heap)

    def _finish_due(self, step: int) -> None:
        """Finish the members whose last token came at `step` (just taken)."""
        heap = self.finishing
        while heap:
            last, _, member = heap[0]
            if not member.done and last != step:
                break
            heapq.heappop(heap)
            if not member.done:  # (a preempted member's entry is only dropped)
                self._stop_decoding(member)
                self._finish(member, step + 1)

    def _finish(self, m: _Member, num_steps: int) -> None:
        self._take_owed(num_steps)
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
        assert self._taken is None, "close with a step taken but not committed"
        k = len(self.step_ts)
        running: list[Request] = []
        for m in self.members:
            if m.done:
                continue
            self._materialize(m, k)
            running.append(m.request)
        if self.prefill is not None:  # the newest
            self.owed -= self.prefill.owed
            running.append(self.prefill.request)
        if self._num_blocks:
            for r in running:
                self._hold(r)
        assert self.owed == 0, f"decode run closed with {self.owed} blocks owed"
        self.ff.close(running, num_steps=k, num_padding_tokens=self.num_padding_tokens)
        return running

    def _hold(self, r: Request) -> None:
        """Take from the pool the blocks running `r` was counted to hold (its owed ones)."""
        if not self.ff.hold(r, self._held_tokens(r)):
            raise AssertionError(f"decode run: no block for {r.request_id!r} it was counted to hold")

    def _held_tokens(self, r: Request) -> int:
        """Tokens running `r` holds blocks for after the run, as stepping leaves it: its first
        allocation, or what it has computed when that is more."""
        computed = r.num_computed_tokens
        return max(self.ff.first_hold(r, min(computed, r.num_prompt_tokens)), computed)


class _Shortage:
    """Step i of a run when the pool cannot give what the running requests ask for, decided as
    the scheduler decides it: in running order each decoding member that grows at step i takes a
    block, then the prefilling member takes its chunk's blocks (within the budget the surviving
    decodes leave), and one the pool cannot serve preempts the victim the KV config's rule picks
    among the running requests not yet preempted (`FastForward.victim_index`; itself, perhaps)
    until it can. Changes nothing: `decide` fills `victims` (in the order preempted), `freed`
    (the blocks they held before this step) and `growth` (the blocks the surviving decoding
    members grow into); the run applies them (`DecodeRun.take`)."""

    def __init__(self, run: DecodeRun, i: int) -> None:
        self.run = run
        self.i = i
        alive: list[_Member | _Prefill] = [m for m in run.members if not m.done]  # running order
        self.running = [*alive, run.prefill] if run.prefill is not None else alive
        self.is_victim = [False] * len(self.running)
        self.grew = [False] * len(self.running)  # took a block in this step
        self.victims: list[_Member | _Prefill] = []
        self.free = run._pool_free - run.owed
        self.freed = 0
        self.growth = 0

    def decide(self) -> tuple[ScheduledChunk | None, int]:
        """Decide the step; the prefilling member's chunk and the blocks it grows into (None, 0
        when it has none or is preempted)."""
        run, i = self.run, self.i
        bs = run.block_size
        for k, m in enumerate(self.running):
            if isinstance(m, _Prefill):
                return self._prefill_chunk(k, m)
            if self.is_victim[k] or not (m.grows_from <= i and (i - m.grows_from) % bs == 0):
                continue
            if self._take(k, 1):
                self.grew[k] = True
                self.growth += 1
        return None, 0

    def _prefill_chunk(self, k: int, pf: _Prefill) -> tuple[ScheduledChunk | None, int]:
        if self.is_victim[k]:
            return None, 0
        decoding = sum([not v for v in self.is_victim[:k]])
        ff = self.run.ff
        chunk = ff.plan(pf.request, ff.max_num_batched_tokens - decoding)
        if chunk is None:
            return None, 0
        need = max(ff.blocks_for(chunk.start + chunk.num_new_tokens) - pf.blocks, 0)
        return (chunk, need) if self._take(k, need) else (None, 0)

    def _take(self, k: int, blocks: int) -> bool:
        """Running request k takes `blocks`, preempting victims while the pool is short; False
        when it is preempted itself."""
        while blocks > self.free:
            if self._preempt_one() == k:
                return False
        self.free -= blocks
        return True

    def _preempt_one(self) -> int:
        """Preempt the victim among the running requests not yet preempted; its index."""
        candidates = [j for j, v in enumerate(self.is_victim) if not v]
        requests = [self.running[j].request for j in candidates]
        j = candidates[self.run.ff.victim_index(requests, [self._generated(self.running[j]) for j in candidates])]
        victim = self.running[j]
        self.is_victim[j] = True
        self.victims.append(victim)
        held = victim.blocks if isinstance(victim, _Prefill) else self._held(victim)
        self.freed += held
        self.free += held + self.grew[j]
        if self.grew[j]:
            self.growth -= 1
        return j

    def _held(self, m: _Member) -> int:
        """Blocks decoding member `m` holds (counted) before step i."""
        return m.request.kv_capacity // self.run.block_size + m.owed_after(self.i, self.run.block_size) - m.owed_at_join

    def _generated(self, x: _Member | _Prefill) -> int:
        """Tokens `x` has generated before step i (a member's request counts those before it
        joined; the run's steps since add one each)."""
        if isinstance(x, _Prefill):
            return x.request.num_output_tokens
        return x.request.num_output_tokens + self.i - x.first


def open_run(ff: FastForward, stop_after: MutableMapping[str, int], *, admits_arrivals: bool) -> DecodeRun:
    """A run starting from the scheduler's state when `ff` was obtained."""
    run = DecodeRun(ff, stop_after, admits_arrivals=admits_arrivals)
    for r in ff.running:
        if r is ff.prefilling:
            run.prefill = _Prefill(r, r.num_computed_tokens, r.kv_capacity // ff.block_size, 0)
        else:
            run._join(r, 0, r.num_computed_tokens, r.num_output_tokens)
    return run
