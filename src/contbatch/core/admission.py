"""Admission: which waiting requests join the running set this step, and what they may displace.

The half of `ContinuousScheduler` that looks at the waiting queue (the other half, in
`contbatch.core.scheduler`, serves running requests). Waiting requests are offered in the queue
order's `candidates(now)` order. One is skipped, without blocking anyone, when its tenant is at
its quota or its client has not read its earlier output (no output credits). Otherwise it is
admitted if a running slot, its next chunk's tokens and its memory fit; if not, with
`priority_preemption` set it may preempt running requests whose priority value is larger by
at least that threshold (at the sequence limit too), and else it blocks the queue or is
passed, as `skip_blocked` and `max_skip_age` say. A new prefill that would be split is refused
in the same way when `max_partial_prefills` are in flight, or, with `defer_partial_prefills`,
when a prefill chunk of the step already samples: its partial chunk would delay those first
tokens, and the step ends sooner without it (it is offered first again next step).

Invariants: a refused admission changes nothing; requests preempted here go back to the queue
only after the candidate iteration ends (the queue never changes while it is being iterated).
"""

from __future__ import annotations

from collections import Counter

from mypy_extensions import mypyc_attr

from contbatch.core.base import SchedulerBase
from contbatch.core.lifecycle import credit_room, may_run
from contbatch.core.outputs import ScheduledChunk
from contbatch.core.plan import plan_chunk
from contbatch.core.request import Request
from contbatch.core.step import StepBuilder


@mypyc_attr(allow_interpreted_subclasses=True)  # the base of an extension point (ContinuousScheduler)
class Admission(SchedulerBase):
    # -- shared with the running phase -------------------------------------------------------
    def _plan(self, request: Request, step: StepBuilder) -> ScheduledChunk | None:
        return self.plan_within(request, step.budget.remaining)

    def plan_within(self, request: Request, max_tokens: int) -> ScheduledChunk | None:
        """`request`'s next chunk in at most `max_tokens` tokens, by this scheduler's rules (its
        client's credits, speculative tokens, when a prefill may be split)."""
        config = self.config
        spec = config.num_speculative_tokens
        room = credit_room(request, config.lifecycle)
        if room is not None:
            if not may_run(request, config.lifecycle):
                return None
            spec = min(spec, room - 1)  # a step must not overrun the client's credits
        return plan_chunk(
            request,
            max_tokens,
            sample_on_prefill=config.sample_on_prefill,
            # recomputing after a preemption may always be split: unsplit, prompt + outputs could
            # outgrow the token budget and never run again
            allow_split=config.chunked_prefill or request.num_preemptions > 0,
            num_speculative_tokens=spec,
            max_prefill_tokens=config.max_prefill_tokens_per_request,
        )

    def _preempt(self, victim: Request, step: StepBuilder, now: float, *, requeue: bool = True) -> None:
        """Take `victim` out of the running set (its chunk this step is refunded); recompute or
        swap per the KV config; back to the queue now, or after admission when `requeue` is off."""
        step.unschedule(victim.request_id)
        moved = self.release_victim(victim, now)
        self.running.remove(victim)
        if requeue:
            self.waiting.push_front(victim)
        else:
            step.requeue.append(victim)
        step.preempted_ids.append(victim.request_id)
        if moved is not None:
            step.swapped_out.append((victim.request_id, moved))

    def release_victim(self, victim: Request, now: float) -> tuple[int, ...] | None:
        """A preempted request's memory and state, as `_preempt` (and `FastForward.preempt`)
        leave them: its device blocks released (those to swap out returned), its pause ended,
        marked preempted at `now`. Leaves the running set and the queue to the caller."""
        moved = self.memory.preempt(victim) if self.memory is not None else None
        self.stats.paused_time += victim.resume(now)
        victim.preempt(now, keep_computed=moved is not None)
        return moved

    # -- the admission phase ------------------------------------------------------------------
    def _admit_waiting(self, step: StepBuilder, now: float) -> None:
        if step.grew_by_preempting:
            return  # no admissions in a step whose running requests had to preempt to grow: no thrash
        admitted: list[Request] = []
        quota = _TenantQuota(self) if self._has_tenant_quota else None
        for request in self.waiting.candidates(now):
            if step.budget.exhausted:
                break
            if (quota is not None and quota.is_full(request)) or not may_run(request, self.config.lifecycle):
                continue  # waits without blocking other tenants / other clients
            if self._admit_one(request, step, now, len(admitted)):
                admitted.append(request)
                self.waiting.admitted(request)
                if quota is not None:
                    quota.add(request)
            elif not self._may_pass(request, now):
                break
        self._finish_admission(admitted, step, now)

    @property
    def _has_tenant_quota(self) -> bool:
        tenants = self.config.tenants
        return tenants.max_running is not None or tenants.max_kv_blocks is not None

    def _finish_admission(self, admitted: list[Request], step: StepBuilder, now: float) -> None:
        step.admitted_ids.update(r.request_id for r in admitted)
        if admitted:
            self.waiting.remove(admitted)
            for request in admitted:
                request.admit(now)
            self.running.extend(admitted)
        for victim in step.requeue:
            self.waiting.push_front(victim)
        step.requeue.clear()

    def _admit_one(self, request: Request, step: StepBuilder, now: float, num_admitted: int) -> bool:
        checked = False
        while True:
            seat_free = len(self.running) + num_admitted < self._max_seqs
            if seat_free and self._try_admit(request, step):
                return True
            victims = self._priority_victims(request)
            if not victims or not (checked or self._victims_make_room(request, step, victims, num_admitted)):
                return False  # nobody is preempted for an admission that would fail anyway
            checked = True
            self._preempt(max(victims, key=lambda v: (v[0], v[1]))[2], step, now, requeue=False)
            self.stats.num_priority_preemptions += 1

    def _priority_victims(self, request: Request) -> list[tuple[int, int, Request]]:
        """(priority, index, request) of the running requests `request` may displace: those whose
        priority value is larger by at least `priority_preemption`."""
        threshold = self.config.priority_preemption
        if threshold is None:
            return []
        return [(r.priority, i, r) for i, r in enumerate(self.running) if r.priority - request.priority >= threshold]

    def _victims_make_room(
        self, request: Request, step: StepBuilder, victims: list[tuple[int, int, Request]], num_admitted: int
    ) -> bool:
        """Whether preempting every eligible victim would free a seat and enough KV blocks."""
        if len(self.running) - len(victims) + num_admitted >= self._max_seqs:
            return False
        chunk = self._plan(request, step)
        if chunk is None:
            return False
        if self.memory is None:
            return True
        freeable = sum(self.memory.kv.num_held_blocks(r.request_id) for _, _, r in victims)
        return self.memory.shortfall(request, chunk.start + chunk.num_new_tokens, extra_free=freeable) == 0

    def _may_pass(self, blocked: Request, now: float) -> bool:
        """Whether requests behind a blocked one may be admitted before it."""
        age_limit = self.config.max_skip_age
        return self.config.skip_blocked and (age_limit is None or now - blocked.arrival_ts < age_limit)

    def _try_admit(self, request: Request, step: StepBuilder) -> bool:
        start = request.num_computed_tokens
        first_admission = start == 0 and request.num_preemptions == 0
        hits = 0
        if start == 0:  # new, or preempted by recompute: its prompt and output blocks may still be cached
            hits = self.memory.prefix_hit_tokens(request) if self.memory is not None else 0
            # external KV (a KV transfer) counts as computed, as a prefix hit does; one token is left to sample from
            external = min(request.num_external_tokens, request.num_prompt_tokens - 1) if first_admission else 0
            request.num_computed_tokens = max(hits, external)
        chunk = self._plan(request, step)
        partial = chunk is not None and _is_partial(request, chunk)
        swapped_in = None
        if chunk is not None and (not partial or self._may_start_partial(step)):
            swapped_in = self._admission_memory(request, chunk, step)
        if chunk is None or swapped_in is None:
            request.num_computed_tokens = start  # refused: nothing changed
            return False
        if first_admission and self.memory is not None and self.memory.config.enable_prefix_caching:
            self.stats.num_prefix_query_tokens += request.num_prompt_tokens
            self.stats.num_prefix_hit_tokens += hits
        if swapped_in:
            step.swapped_in.append((request.request_id, swapped_in))
        else:
            step.new_requests.append(request)
        if partial:
            step.num_new_partial_prefills += 1
        step.budget.try_consume(chunk.num_new_tokens)
        step.add(chunk)
        return True

    def _may_start_partial(self, step: StepBuilder) -> bool:
        """Whether a new prefill may start with a partial chunk in `step`: fewer than
        `max_partial_prefills` in flight, and, with `defer_partial_prefills`, no prefill chunk of
        the step sampling."""
        cap = self.config.max_partial_prefills
        if cap is not None:
            in_flight = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
            if in_flight + step.num_new_partial_prefills >= cap:
                return False
        return not (self.config.defer_partial_prefills and _yields_from_prefill(step))

    def _admission_memory(self, request: Request, chunk: ScheduledChunk, step: StepBuilder) -> tuple[int, ...] | None:
        """Device blocks a swapped-out request got back (empty tuple for others), or None when its
        memory does not fit."""
        if self.memory is None:
            return ()
        return self.memory.admit(request, chunk, alone=not self.running and not step.chunks)


def _is_partial(request: Request, chunk: ScheduledChunk) -> bool:
    return chunk.start + chunk.num_new_tokens < request.num_prompt_tokens


def _yields_from_prefill(step: StepBuilder) -> bool:
    """Whether a prefill chunk of `step` samples: the step yields a prompt's first token (or,
    after a recompute, its next one)."""
    return any(c.is_prefill and c.samples for c in step.chunks.values())


class _TenantQuota:
    """Per-tenant running requests and KV blocks, counted once per admission phase."""

    def __init__(self, scheduler: SchedulerBase) -> None:
        self.config = scheduler.config.tenants
        self.memory = scheduler.memory
        self.running: Counter[str | None] = Counter(r.tenant for r in scheduler.running)
        self.blocks: Counter[str | None] = Counter()
        if self.memory is not None and self.config.max_kv_blocks is not None:
            for r in scheduler.running:
                self.blocks[r.tenant] += self.memory.kv.num_held_blocks(r.request_id)

    def is_full(self, request: Request) -> bool:
        cfg = self.config
        if cfg.max_running is not None and self.running[request.tenant] >= cfg.max_running:
            return True
        if cfg.max_kv_blocks is None or self.memory is None:
            return False
        # a request preempted before needs room for all it knew (the memory's thrash guard); under
        # reserve admission it takes its whole reservation at once
        first = self.memory.first_hold(request, request.num_prompt_tokens)
        need = self.memory.kv.num_blocks_for(max(first, request.num_known_tokens))
        return self.blocks[request.tenant] + need > cfg.max_kv_blocks

    def add(self, request: Request) -> None:
        self.running[request.tenant] += 1
        if self.memory is not None:
            self.blocks[request.tenant] += self.memory.kv.num_held_blocks(request.request_id)
