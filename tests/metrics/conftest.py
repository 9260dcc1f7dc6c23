"""Shared builders for metrics tests: timelines recorded by hand, in event order."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline

MakeTimeline = Callable[..., Timeline]


def build_timeline(
    request_id: str,
    arrival: float,
    *,
    scheduled: Sequence[float] = (),
    preempted: Sequence[float] = (),
    tokens: Sequence[float] = (),
    counts: Sequence[int] | None = None,
    finished: float | None = None,
    reason: FinishReason = FinishReason.LENGTH,
    num_prompt_tokens: int = 1,
    tenant: str | None = None,
    priority: int = 0,
) -> Timeline:
    """Record every event through the Timeline API, so its invariants are checked too.

    Ties are recorded in `events()` order: SCHEDULED, PREEMPTED, TOKENS, FINISHED.
    """
    tl = Timeline(request_id, arrival, num_prompt_tokens, tenant=tenant, priority=priority)
    token_counts = list(counts) if counts is not None else [1] * len(tokens)
    events: list[tuple[float, int, int]] = []
    events += [(ts, 0, 0) for ts in scheduled]
    events += [(ts, 1, 0) for ts in preempted]
    events += [(ts, 2, n) for ts, n in zip(tokens, token_counts, strict=True)]
    for ts, kind, n in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            tl.record_scheduled(ts)
        elif kind == 1:
            tl.record_preempted(ts)
        else:
            tl.record_tokens(ts, n)
    if finished is not None:
        tl.record_finished(finished, reason)
    return tl


@pytest.fixture(scope="session")
def make_tl() -> MakeTimeline:
    return build_timeline


def seed_continuous() -> list[Timeline]:
    """The seed trace A=(0,4,5), B=(0,2,2), C=(3,3,4) under continuous batching (8 token-work/tick)."""
    return [
        build_timeline("A", 0, scheduled=[0], tokens=[2, 3, 4, 5, 6], finished=6, num_prompt_tokens=4),
        build_timeline("B", 0, scheduled=[0], tokens=[2, 3], finished=3, num_prompt_tokens=2),
        build_timeline("C", 3, scheduled=[3], tokens=[5, 6, 7, 8], finished=8, num_prompt_tokens=3),
    ]


def seed_static() -> list[Timeline]:
    """The same trace under static batching: C waits for the A/B batch to drain."""
    return [
        build_timeline("A", 0, scheduled=[0], tokens=[2, 3, 4, 5, 6], finished=6, num_prompt_tokens=4),
        build_timeline("B", 0, scheduled=[0], tokens=[2, 3], finished=3, num_prompt_tokens=2),
        build_timeline("C", 3, scheduled=[6], tokens=[8, 9, 10, 11], finished=11, num_prompt_tokens=3),
    ]


@pytest.fixture
def continuous() -> list[Timeline]:
    return seed_continuous()


@pytest.fixture
def static() -> list[Timeline]:
    return seed_static()
