"""Driving a scheduler by hand in tests: what an executor would return, one whole step, and the
small readers the tests of `contbatch.core` share. Each helper is defined here once; test modules
import them (`from .drive import step, add, ...`). `conftest.py` beside this file has pytest
rewrite this module's asserts, so a failing helper assert shows its values as a test's would."""

from __future__ import annotations

from contbatch.core import Request, SchedulerBase, SchedulerOutput, StepResult, check_invariants


# -- what an executor returns -------------------------------------------------------------------
def sampled(out: SchedulerOutput) -> StepResult:
    """One dummy token for every chunk that samples (speculative drafts all rejected)."""
    return StepResult(sampled_token_ids={c.request_id: (0,) for c in out.chunks if c.samples})


accept_none = sampled  # every speculative draft rejected: one token per sampling chunk


def accept_all(out: SchedulerOutput) -> StepResult:
    """Every speculative draft accepted: a decode chunk of n tokens yields n tokens, a prefill 1."""
    return StepResult(
        sampled_token_ids={
            c.request_id: (0,) * (1 if c.is_prefill else c.num_new_tokens) for c in out.chunks if c.samples
        }
    )


# -- stepping -----------------------------------------------------------------------------------
def step(s: SchedulerBase, now: float, dt: float = 1.0) -> SchedulerOutput:
    """schedule at `now`, execute (`sampled`), update at `now + dt`; invariants checked before the
    step, after `schedule` when there is no KV pool (with one, blocks for the step's chunks are
    held before the update, so the memory invariants hold only between steps), and after update."""
    check_invariants(s)
    out = s.schedule(now)
    if s.memory is None:
        check_invariants(s)
    s.update(out, sampled(out), now + dt)
    check_invariants(s)
    return out


def run_to_end(s: SchedulerBase, now: float, limit: int = 500) -> list[SchedulerOutput]:
    """`step` once a tick from `now` until nothing is unfinished; every step must schedule work."""
    outs: list[SchedulerOutput] = []
    for _ in range(limit):
        if not s.has_unfinished():
            return outs
        out = step(s, now)
        assert not out.is_empty, f"scheduled nothing with work pending at {now}: {list(s.requests.values())}"
        outs.append(out)
        now += 1.0
    raise AssertionError("did not finish")


# -- requests -----------------------------------------------------------------------------------
def add(s: SchedulerBase, rid: str, now: float, prompt: int, output: int, **kw: object) -> Request:
    """A request arriving at `now` (admitted, queued or rejected), invariants checked after."""
    request = Request(rid, now, prompt, output, **kw)  # type: ignore[arg-type]
    s.add_request(request, now)
    check_invariants(s)
    return request


def admit(s: SchedulerBase, rid: str, now: float, prompt: int, output: int, **kw: object) -> Request:
    """`add`, for a request that must not be rejected."""
    request = Request(rid, now, prompt, output, **kw)  # type: ignore[arg-type]
    assert s.add_request(request, now), f"{rid!r} rejected: {request.finish_detail}"
    check_invariants(s)
    return request


# -- readers ------------------------------------------------------------------------------------
def scheduled_ids(out: SchedulerOutput) -> list[str]:
    """The ids of a step's chunks, in the step's order."""
    return [c.request_id for c in out.chunks]


def held(s: SchedulerBase, rid: str) -> int:
    """Device blocks held by `rid`."""
    assert s.memory is not None
    return s.memory.kv.num_held_blocks(rid)


def held_device_host(s: SchedulerBase, rid: str) -> tuple[int, int]:
    """(device, host) blocks held by `rid`."""
    assert s.memory is not None
    kv = s.memory.kv
    return kv.num_held_blocks(rid), kv.num_held_host_blocks(rid)
