"""`check_invariants(scheduler)`: the scheduler's invariants, checked after every step in tests.

Raises `InvariantError` naming the first violation. Cheap enough for tests, never called on
the hot path.
"""

from __future__ import annotations

from contbatch.core.base import SchedulerBase
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.core.static import StaticScheduler
from contbatch.core.status import RequestStatus


class InvariantError(AssertionError):
    """A scheduler invariant does not hold."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)


def check_invariants(scheduler: SchedulerBase) -> None:
    _check_membership(scheduler)
    _check_requests(scheduler)
    _check_last_output(scheduler)
    if scheduler.memory is not None:
        _check_memory(scheduler)


def _check_memory(s: SchedulerBase) -> None:
    """Between steps a running request holds exactly the blocks its computed tokens need (its
    whole reservation under `reserve`); nobody else holds device blocks; with no unfinished
    request every block is free."""
    assert s.memory is not None
    kv = s.memory.kv
    kv.check_invariants()
    reserve = s.memory.config.admission == "reserve" or isinstance(s, StaticScheduler)
    for r in s.requests.values():
        capacity = kv.num_held_blocks(r.request_id) * kv.block_size
        _require(r.kv_capacity == capacity, f"{r.request_id!r}: kv_capacity {r.kv_capacity} != {capacity}")
    for r in s.running:
        tokens = r.num_prompt_tokens + r.max_output_tokens if reserve else r.num_computed_tokens
        held = kv.num_held_blocks(r.request_id)
        _require(held == kv.num_blocks_for(tokens), f"{r.request_id!r} holds {held} blocks for {tokens} tokens")
    for r in s.waiting:
        _require(kv.num_held_blocks(r.request_id) == 0, f"waiting {r.request_id!r} holds device blocks")
        if kv.is_swapped(r.request_id):
            _require(r.num_computed_tokens > 0, f"swapped {r.request_id!r} has nothing computed")
    if not s.requests:
        _require(kv.num_used_blocks == 0, f"{kv.num_used_blocks} blocks still used with no request left")


def _check_membership(s: SchedulerBase) -> None:
    waiting_ids = [r.request_id for r in s.waiting]
    running_ids = [r.request_id for r in s.running]
    _require(len(set(waiting_ids)) == len(waiting_ids), "a request is queued twice")
    _require(len(set(running_ids)) == len(running_ids), "a request runs twice")
    both = set(waiting_ids) & set(running_ids)
    _require(not both, f"requests both waiting and running: {sorted(both)}")
    members = set(waiting_ids) | set(running_ids)
    _require(
        members == set(s.requests), f"unfinished requests outside waiting/running: {sorted(set(s.requests) - members)}"
    )
    limit = s.config.max_num_seqs
    _require(limit is None or len(running_ids) <= limit, f"{len(running_ids)} running > max_num_seqs {limit}")


def _check_requests(s: SchedulerBase) -> None:
    for r in s.running:
        _require(r.status is RequestStatus.RUNNING, f"{r.request_id!r} is running with status {r.status.value}")
    for r in s.waiting:
        _require(r.status.is_waiting, f"{r.request_id!r} is waiting with status {r.status.value}")
    for r in s.requests.values():
        _require(r.finish_reason is None, f"{r.request_id!r} is unfinished with a finish reason")
        _require(0 <= r.num_computed_tokens <= r.num_known_tokens, f"{r.request_id!r}: computed out of range")
        _require(r.num_output_tokens <= r.max_output_tokens, f"{r.request_id!r}: more outputs than its maximum")
        _require(r.num_output_tokens == r.timeline.num_output_tokens, f"{r.request_id!r}: timeline disagrees")


def _check_last_output(s: SchedulerBase) -> None:
    out = s.last_output
    if out is None:
        return
    ids = [c.request_id for c in out.chunks]
    _require(len(set(ids)) == len(ids), f"step {out.step_id}: a request is scheduled twice")
    total = sum(c.num_new_tokens for c in out.chunks)
    _require(total == out.num_batched_tokens, f"step {out.step_id}: num_batched_tokens disagrees with chunks")
    _require(all(c.num_new_tokens >= 1 for c in out.chunks), f"step {out.step_id}: an empty chunk")
    if isinstance(s, ContinuousScheduler):
        budget = s.config.max_num_batched_tokens
        _require(total <= budget, f"step {out.step_id}: {total} tokens > budget {budget}")
