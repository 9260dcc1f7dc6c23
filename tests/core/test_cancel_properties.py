"""Random cancellations while the loop is driven by hand (schedule / execute / update).

Requests are cancelled before a step (waiting or running) and while a step is in flight; the
invariants are checked after every call, and at the end every request has exactly one finish
reason: cancelled ones CANCELLED (with their partial output kept), the rest LENGTH or REJECTED.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from contbatch.core import (
    ContinuousScheduler,
    EventKind,
    FinishReason,
    Request,
    SchedulerBase,
    SchedulerConfig,
    StaticScheduler,
    check_invariants,
)

from .drive import sampled

MAX_STEPS = 2_000


@dataclass(frozen=True)
class Cancel:
    step: int
    index: int  # which request: among the unfinished ones, or among all when `any_request`
    any_request: bool  # may name one not arrived yet or finished already (cancel answers False)
    in_flight: bool  # between schedule() and update() of that step


configs = st.builds(
    SchedulerConfig,
    max_num_batched_tokens=st.integers(1, 64),
    max_num_seqs=st.none() | st.integers(1, 8),
    sample_on_prefill=st.booleans(),
    chunked_prefill=st.booleans(),
    skip_blocked=st.booleans(),
    max_model_len=st.none() | st.integers(2, 40),
)
specs = st.lists(
    st.tuples(st.integers(0, 12), st.integers(1, 40), st.integers(1, 8)),  # arrival, prompt, output
    min_size=1,
    max_size=10,
)


def drive(s: SchedulerBase, requests: list[Request], cancels: list[Cancel]) -> set[str]:
    """Run to the end; return the ids whose cancel() returned True."""
    pending = sorted(requests, key=lambda r: r.arrival_ts)
    by_step: dict[int, list[Cancel]] = {}
    for c in cancels:
        by_step.setdefault(c.step, []).append(c)
    cancelled: set[str] = set()
    now, step, nxt = 0.0, 0, 0

    def cancel_all(in_flight: bool, ts: float) -> None:
        for c in by_step.get(step, []):
            if c.in_flight != in_flight:
                continue
            live = sorted(s.requests)
            if c.any_request or not live:
                request = requests[c.index % len(requests)]
            else:
                request = s.requests[live[c.index % len(live)]]
            expected = request.request_id in s.requests
            if expected:
                event(f"cancel {request.status.value}{' in flight' if in_flight else ''}")
            outputs_before = request.num_output_tokens
            assert s.cancel(request.request_id, ts) == expected
            check_invariants(s)
            if expected:
                cancelled.add(request.request_id)
                assert request.finish_reason is FinishReason.CANCELLED
                assert request.num_output_tokens == outputs_before

    while step < MAX_STEPS:
        while nxt < len(pending) and pending[nxt].arrival_ts <= now:
            s.add_request(pending[nxt], now)
            check_invariants(s)
            nxt += 1
        cancel_all(False, now)
        out = s.schedule(now)
        check_invariants(s)
        if out.is_empty:
            assert not s.running, "running requests got no work"
            if nxt == len(pending):
                assert not s.has_unfinished(), "stalled with work pending"
                return cancelled
            now = max(now, pending[nxt].arrival_ts)
            step += 1
            continue
        cancel_all(True, now + 0.5)
        outputs_before = {r.request_id: r.num_output_tokens for r in requests if r.request_id in cancelled}
        s.update(out, sampled(out), now + 1.0)
        check_invariants(s)
        for r in requests:  # tokens of a step in flight are dropped for a cancelled request
            if r.request_id in outputs_before:
                assert r.num_output_tokens == outputs_before[r.request_id]
        now += 1.0
        step += 1
    raise AssertionError("the run did not end")


@settings(
    max_examples=3 * settings().max_examples,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    config=configs,
    static=st.booleans(),
    spec_list=specs,
    cancels=st.lists(
        st.builds(
            Cancel,
            step=st.integers(0, 15),
            index=st.integers(0, 9),
            any_request=st.booleans(),
            in_flight=st.booleans(),
        ),
        max_size=8,
    ),
)
def test_random_cancellations(
    config: SchedulerConfig, static: bool, spec_list: list[tuple[int, int, int]], cancels: list[Cancel]
) -> None:
    s: SchedulerBase = StaticScheduler(config) if static else ContinuousScheduler(config)
    requests = [Request(f"r{i}", float(a), p, o) for i, (a, p, o) in enumerate(spec_list)]
    cancelled = drive(s, requests, cancels)
    assert not s.requests and not s.running and not s.waiting
    assert s.num_finished == len(requests)
    for r in requests:
        finished = [e for e in r.timeline.events() if e.kind is EventKind.FINISHED]
        assert len(finished) == 1 and finished[0].reason is r.finish_reason is r.timeline.finish_reason
        assert r.num_output_tokens == r.timeline.num_output_tokens <= r.max_output_tokens
        if r.request_id in cancelled:
            assert r.finish_reason is FinishReason.CANCELLED
        elif r.finish_reason is FinishReason.REJECTED:
            assert r.finish_detail and r.num_output_tokens == 0 and not r.timeline.scheduled_ts
        else:
            assert r.finish_reason is FinishReason.LENGTH
            assert r.num_output_tokens == r.max_output_tokens
