"""`contbatch.engine.replay.shifted`: a replayed timeline moved to a clock starting at 0 keeps
every event, in order (admissions, preemptions, tokens, the finish)."""

from __future__ import annotations

from contbatch.core import Timeline
from contbatch.core.status import FinishReason
from contbatch.engine.replay import shifted


def test_shifted_keeps_every_event_in_order() -> None:
    tl = Timeline("r", 100.0, 8, tenant="t", priority=2, deadline_ts=105.0)
    tl.record_scheduled(100.5)
    tl.record_tokens(101.0)
    tl.record_preempted(101.5)
    tl.record_scheduled(102.0)
    tl.record_tokens(102.5, 2)
    tl.record_finished(103.0, FinishReason.LENGTH)
    moved = shifted(tl, 100.0)
    assert (moved.arrival_ts, moved.deadline_ts, moved.tenant, moved.priority) == (0.0, 5.0, "t", 2)
    assert moved.scheduled_ts == [0.5, 2.0] and moved.preempted_ts == [1.5]
    assert moved.token_ts == [1.0, 2.5] and moved.token_counts == [1, 2]
    assert (moved.finished_ts, moved.finish_reason) == (3.0, FinishReason.LENGTH)
