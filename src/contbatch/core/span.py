"""Decode spans: many steps of pure decoding, planned and applied at once (the simulator's
skip-ahead).

When every running request is decoding one token per step and nothing else can happen until an
outside event (an arrival, a cancellation), the next steps are fully determined: each request
decodes until it finishes, the batch shrinks as they do, and the KV pool gives each its next
block at a block boundary. `plan_decode_span` checks that this holds and describes the steps
(batch size, attended context, blocks in use, bucket padding per step); the caller prices them
and decides how many to take; `apply_decode_span` applies them exactly as that many
schedule/update calls would, so a run with spans gives the same per-request timelines as one
without (tested).

It refuses (returns None) whenever a step could involve a decision: a waiting request (a
completion could let it in), prefill or recompute work, speculative decoding, output credits,
timeouts, prefix caching (block reuse order), the seed semantics, more decodes than the token
budget, or a KV shortage at the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from contbatch.core.outputs import SchedulerOutput
from contbatch.core.request import Request
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.core.status import FinishReason, RequestStatus


@dataclass(slots=True)
class _Changes:
    """Per step (1-based): blocks newly needed, and what the requests finishing at it release."""

    growth: list[int]
    ends: list[int]
    ended_context: list[int]
    freed: list[int]


@dataclass(frozen=True, slots=True)
class DecodeSpan:
    requests: tuple[Request, ...]  # the running set, in admission order
    steps_left: tuple[int, ...]  # per request: the step (1-based) at which it emits its last token
    stopping: frozenset[str]  # requests whose last token is an executor stop (else their length limit)
    changes: _Changes
    first_step_id: int
    num_blocks: tuple[int, int, int]  # block size, free and used blocks before the span (0, 0, 0: no KV)
    bucket_padding: Callable[[int], int]

    def steps(self) -> Iterator[tuple[SchedulerOutput, int]]:
        """Each step's shape (chunks omitted) and the KV blocks in use while it runs, in order,
        until every request has finished or the pool cannot give a step's growth."""
        ch = self.changes
        block_size, free, used = self.num_blocks
        num, context_base = len(self.requests), sum(r.num_computed_tokens for r in self.requests)
        for j in range(1, len(ch.growth) - 1):
            if num == 0 or (block_size and ch.growth[j] > free):
                return
            free, used = free - ch.growth[j], used + ch.growth[j]
            padding = self.bucket_padding(num)
            step_id = self.first_step_id + j - 1
            yield SchedulerOutput(step_id, (), num, 0, num, context_base + num * j, padding, num_requests=num), used
            num -= ch.ends[j]
            context_base -= ch.ended_context[j]
            free, used = free + ch.freed[j], used - ch.freed[j]


def plan_decode_span(
    scheduler: ContinuousScheduler, stop_after: Mapping[str, int], max_steps: int
) -> DecodeSpan | None:
    """The next steps as a span of at most `max_steps` steps, or None when they are not pure
    decoding. `stop_after[id]`: tokens the executor will still emit before it stops the request."""
    running = scheduler.running
    if not running or max_steps < 2 or not _eligible(scheduler):
        return None
    steps_left: list[int] = []
    stopping: set[str] = set()
    for r in running:
        if r.num_computed_tokens != r.num_known_tokens - 1 or r.num_computed_tokens < r.num_prompt_tokens:
            return None
        left = r.max_output_tokens - r.num_output_tokens
        stop = stop_after.get(r.request_id)
        if stop is not None and stop <= left:
            left = stop
            stopping.add(r.request_id)
        steps_left.append(left)
    memory = scheduler.memory
    kv = (memory.kv.block_size, memory.kv.num_free_blocks, memory.kv.num_used_blocks) if memory else (0, 0, 0)
    changes = _changes(running, steps_left, min(max_steps, max(steps_left)), kv[0])
    if kv[0] and changes.growth[1] > kv[1]:
        return None  # the very next step needs a preemption
    return DecodeSpan(
        tuple(running),
        tuple(steps_left),
        frozenset(stopping),
        changes,
        scheduler._step_id,
        kv,
        scheduler.bucket_padding_for,
    )


def may_skip(s: ContinuousScheduler) -> bool:
    """Cheap pre-check: could the next steps be a decode span at all (no waiting request, no
    lifecycle timers or credits, no prefix caching, engine semantics)?"""
    return bool(s.running) and _eligible(s)


def _eligible(s: ContinuousScheduler) -> bool:
    cfg = s.config
    memory = s.memory
    return not (
        s.waiting
        or not cfg.sample_on_prefill
        or cfg.num_speculative_tokens
        or cfg.lifecycle.output_credits is not None
        or cfg.lifecycle.has_timeouts
        or len(s.running) > cfg.max_num_batched_tokens
        or (memory is not None and memory.config.enable_prefix_caching)
    )


def _changes(running: list[Request], steps_left: list[int], k: int, block_size: int) -> _Changes:
    ch = _Changes([0] * (k + 2), [0] * (k + 2), [0] * (k + 2), [0] * (k + 2))
    for r, left in zip(running, steps_left, strict=True):
        c = r.num_computed_tokens
        if left <= k:
            ch.ends[left] += 1
            ch.ended_context[left] += c
            ch.freed[left] += max(-(-(c + left) // block_size), r.kv_capacity // block_size) if block_size else 0
        if block_size:
            j = r.kv_capacity - c + 1  # the first step whose token does not fit what it holds
            while j <= min(left, k):
                ch.growth[j] += 1
                j += block_size
    return ch


def apply_decode_span(
    scheduler: ContinuousScheduler, span: DecodeSpan, step_end_ts: list[float], num_padding_tokens: int
) -> list[Request]:
    """Apply the span's first `len(step_end_ts)` steps (each ending at its timestamp, with
    `num_padding_tokens` of bucket padding in all); returns the requests that finished.
    Equivalent to that many schedule/update calls."""
    k = len(step_end_ts)
    done: list[Request] = []
    for request, left in zip(span.requests, span.steps_left, strict=True):
        n = min(k, left)
        request.append_token_run(0, step_end_ts[:n])
        if scheduler._charges_service:
            scheduler.waiting.charge(request, n)
        if n == left:  # released before the others grow: the plan checked the pool step by step
            reason = FinishReason.STOP if request.request_id in span.stopping else FinishReason.LENGTH
            scheduler._finish(request, reason, step_end_ts[n - 1])
            done.append(request)
    if scheduler.memory is not None:
        for request in span.requests:
            if not request.is_finished:
                scheduler.memory.grow(request, request.num_computed_tokens)
        for _ in range(k):
            scheduler.memory.end_step(preempted=False)
    if done:
        scheduler.running = [r for r in scheduler.running if r.status is RequestStatus.RUNNING]
    scheduler._step_id += k
    scheduler.stats.num_bucket_padding_tokens += num_padding_tokens
    return done
