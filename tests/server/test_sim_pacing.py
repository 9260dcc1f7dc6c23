"""The sim backend's pacing (`PacedSimExecutor`) on a fake clock: a step launched with no idle wait
since the previous one starts when that one ended, however late the launch (the step boundaries
stay the simulator's); after an idle wait, or a step with nothing to compute, a step starts
when it is launched."""

from __future__ import annotations

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput
from contbatch.server.backends.sim import PacedSimExecutor
from contbatch.sim import parse_cost

COST = parse_cost("affine:base_ms=10")


class FakeTime:
    """A clock that moves only when slept on, or when the test says the driver ran late."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _step(step_id: int) -> SchedulerOutput:
    chunk = ScheduledChunk("r", 8 + step_id, 1, is_prefill=False, samples=True)
    return SchedulerOutput(step_id, (chunk,), 1, 0, 1, chunk.start + 1, num_requests=1)


def _executor() -> tuple[PacedSimExecutor, FakeTime]:
    t = FakeTime()
    return PacedSimExecutor(COST, clock=t.clock, sleep=t.sleep), t


def _ends(*step_ids: int) -> list[float]:
    """When back-to-back steps `step_ids` end, the first starting at 100.0."""
    ends, now = [], 100.0
    for i in step_ids:
        now += COST.step_time(_step(i))
        ends.append(now)
    return ends


def test_back_to_back_steps_end_one_step_time_apart() -> None:
    ex, t = _executor()
    ends = []
    for i in range(3):
        ex.execute(_step(i))
        ends.append(t.now)
    assert ends == _ends(0, 1, 2)


def test_a_late_launch_is_caught_up_whatever_its_lateness() -> None:
    ex, t = _executor()
    ends = _ends(0, 1, 2, 3)
    ex.execute(_step(0))
    t.now += 0.005  # the driver ran late: half a step
    ex.execute(_step(1))
    assert t.now == ends[1]
    t.now += 0.05  # five steps late (a starved process): no sleep, the boundary kept
    sleeps = len(t.sleeps)
    ex.execute(_step(2))
    assert len(t.sleeps) == sleeps  # it ended before it was launched
    t.now = ends[2]  # (the fake clock's lateness undone, to read the next boundary)
    ex.execute(_step(3))
    assert t.now == ends[3]


def test_after_an_idle_wait_or_a_bookkeeping_step_a_step_starts_when_launched() -> None:
    for end_busy_period in ("idle", "bookkeeping"):
        ex, t = _executor()
        ex.execute(_step(0))
        if end_busy_period == "idle":
            ex.idle()
        else:
            ex.execute(SchedulerOutput(1, (), 0, 0, 0, 0))
        t.now += 0.5
        launched = t.now
        ex.execute(_step(2))
        assert t.now == launched + COST.step_time(_step(2)), end_busy_period
