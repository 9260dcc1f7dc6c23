"""The sim backend's pacing (`PacedSimExecutor`) on a fake clock: a step launched within one step
time of the previous one's end, with no idle wait in between, starts when that one ended (the
driver's own time overlaps the device step, as with asynchronous scheduling); a launch later
than that, or after an idle wait, starts the step when it is launched (a host that falls
behind delays the device, as on a real server)."""

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


def test_a_launch_late_by_less_than_a_step_is_hidden_and_a_later_one_delays() -> None:
    ex, t = _executor()
    ends = _ends(0, 1)
    ex.execute(_step(0))
    t.now += 0.005  # the driver's own time: half a step
    ex.execute(_step(1))
    assert t.now == ends[1]  # hidden: the step started when the previous one ended
    t.now += 0.05  # five steps late (a starved process)
    launched = t.now
    ex.execute(_step(2))
    assert t.now == launched + COST.step_time(_step(2))  # the device waited for the host


def test_after_an_idle_wait_a_step_starts_when_launched() -> None:
    ex, t = _executor()
    ex.execute(_step(0))
    ex.idle()
    t.now += 0.001  # (within a step time: only the idle wait tells)
    launched = t.now
    ex.execute(_step(1))
    assert t.now == launched + COST.step_time(_step(1))
