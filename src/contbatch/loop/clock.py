"""The loop's clocks: when a step starts and when it ends.

`EngineCore` reads the time only through a `Clock`. A step starts at `now()` and ends at
`step_end(out, start)`:
- `VirtualClock` (the simulator): time is a number the loop moves. A step ends when its price
  says (`StepPricer.step_time`, a cost model), and idle time passes only by `advance_to`.
- `WallClock` (the engine and the server): `time.monotonic()`; a step ends when its executor
  returned, never before it started.

Invariant: neither clock goes back; `step_end(out, start) >= start`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from contbatch.core.outputs import SchedulerOutput


class StepPricer(Protocol):
    """What the virtual clock needs of a cost model (`contbatch.sim.cost.CostModel` has it)."""

    @property
    def time_unit(self) -> str: ...

    def step_time(self, out: SchedulerOutput) -> float: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def step_end(self, out: SchedulerOutput, start: float) -> float: ...


class VirtualClock:
    """Simulated time, in the pricer's unit (`time_unit`). `ts` is the time now (read it; move it
    only through the methods)."""

    __slots__ = ("pricer", "time_unit", "ts")

    def __init__(self, pricer: StepPricer, start: float = 0.0) -> None:
        self.pricer = pricer
        self.time_unit = pricer.time_unit
        self.ts = start

    def now(self) -> float:
        return self.ts

    def step_end(self, out: SchedulerOutput, start: float) -> float:
        self.ts = end = start + self.pricer.step_time(out)
        return end

    def advance_to(self, ts: float) -> None:
        """Idle until `ts`, or a step priced elsewhere ended then (no-op unless in the future)."""
        self.ts = max(self.ts, ts)


class WallClock:
    """Real time: `time_fn` (default `time.monotonic`), in seconds."""

    __slots__ = ("_time",)
    time_unit = "s"

    def __init__(self, time_fn: Callable[[], float] = time.monotonic) -> None:
        self._time = time_fn

    def now(self) -> float:
        return self._time()

    def step_end(self, out: SchedulerOutput, start: float) -> float:
        return max(self._time(), start)
