"""Timeline invariants: time never goes back, nothing after FINISHED, TOKENS carry n >= 1."""

from __future__ import annotations

import pytest

from contbatch.core.status import FinishReason
from contbatch.core.timeline import EventKind, Timeline, TimelineError


def make() -> Timeline:
    return Timeline("r", 1.0, 4)


def test_records_in_order_and_reads_back() -> None:
    tl = make()
    tl.record_scheduled(1.0)  # equal timestamps are fine
    tl.record_tokens(2.0)
    tl.record_preempted(2.0)
    tl.record_scheduled(3.0)
    tl.record_tokens(4.0, 3)
    tl.record_finished(4.0, FinishReason.LENGTH)
    assert tl.num_output_tokens == 4
    assert tl.first_token_ts == 2.0
    assert tl.is_finished and tl.finish_reason is FinishReason.LENGTH and tl.finished_ts == 4.0
    kinds = [(e.kind, e.ts, e.num_tokens) for e in tl.events()]
    assert kinds == [
        (EventKind.ARRIVED, 1.0, 0),
        (EventKind.SCHEDULED, 1.0, 0),
        (EventKind.PREEMPTED, 2.0, 0),  # ties sort by kind, not by recording order
        (EventKind.TOKENS, 2.0, 1),
        (EventKind.SCHEDULED, 3.0, 0),
        (EventKind.TOKENS, 4.0, 3),
        (EventKind.FINISHED, 4.0, 0),
    ]
    assert [e.reason for e in tl.events() if e.kind is EventKind.FINISHED] == [FinishReason.LENGTH]


def test_empty_timeline() -> None:
    tl = make()
    assert tl.num_output_tokens == 0 and tl.first_token_ts is None and not tl.is_finished
    assert [e.kind for e in tl.events()] == [EventKind.ARRIVED]


@pytest.mark.parametrize("kind", ["scheduled", "preempted", "tokens", "finished"])
def test_nothing_before_arrival(kind: str) -> None:
    tl = make()
    with pytest.raises(TimelineError, match="before previous event"):
        _record(tl, kind, 0.5)
    _assert_empty(tl)


@pytest.mark.parametrize("kind", ["scheduled", "preempted", "tokens", "finished"])
def test_time_never_goes_back(kind: str) -> None:
    tl = make()
    tl.record_scheduled(3.0)
    with pytest.raises(TimelineError, match="before previous event"):
        _record(tl, kind, 2.999)
    assert tl.scheduled_ts == [3.0]
    assert not tl.preempted_ts and not tl.token_ts and not tl.is_finished


@pytest.mark.parametrize("kind", ["scheduled", "preempted", "tokens", "finished"])
def test_nothing_after_finished(kind: str) -> None:
    tl = make()
    tl.record_finished(2.0, FinishReason.CANCELLED)
    with pytest.raises(TimelineError, match="after FINISHED"):
        _record(tl, kind, 5.0)
    assert tl.finish_reason is FinishReason.CANCELLED and tl.finished_ts == 2.0
    assert not tl.scheduled_ts and not tl.preempted_ts and not tl.token_ts


@pytest.mark.parametrize("n", [0, -1])
def test_tokens_need_at_least_one(n: int) -> None:
    tl = make()
    with pytest.raises(TimelineError, match="n >= 1"):
        tl.record_tokens(2.0, n)
    _assert_empty(tl)
    tl.record_scheduled(1.5)  # a refused event did not move the clock
    assert tl.scheduled_ts == [1.5]


def _record(tl: Timeline, kind: str, ts: float) -> None:
    if kind == "finished":
        tl.record_finished(ts, FinishReason.LENGTH)
    else:
        getattr(tl, f"record_{kind}")(ts)


def _assert_empty(tl: Timeline) -> None:
    assert not tl.scheduled_ts and not tl.preempted_ts and not tl.token_ts and not tl.token_counts
    assert tl.finished_ts is None and tl.finish_reason is None
