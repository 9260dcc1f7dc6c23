"""Driving a scheduler by hand in tests: what an executor would return, and one whole step."""

from __future__ import annotations

from contbatch.core import SchedulerBase, SchedulerOutput, StepResult, check_invariants


def sampled(out: SchedulerOutput) -> StepResult:
    """One dummy token for every chunk that samples."""
    return StepResult(sampled_token_ids={c.request_id: (0,) for c in out.chunks if c.samples})


def step(s: SchedulerBase, now: float, dt: float = 1.0) -> SchedulerOutput:
    """schedule at `now`, execute, update at `now + dt`; invariants checked between steps (with a
    KV pool, blocks for the step's chunks are held before the update)."""
    check_invariants(s)
    out = s.schedule(now)
    s.update(out, sampled(out), now + dt)
    check_invariants(s)
    return out
