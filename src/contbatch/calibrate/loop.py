"""Step times of a real engine run: what the engine loop spends per step, runner included.

`StepRecorder` instruments one `LLMEngine` for the length of a `with` block: it records, per
non-empty step, the scheduler's `SchedulerOutput`, the runner's execute time and the step's
*cycle* time, from the start of this `engine.step()` call to the start of the next one. The cycle
is what the simulator's clock advances by per step (the next schedule happens when the previous
step's results are applied and the loop has taken in new arrivals). A step after which the
engine had nothing left to run is followed by idle waiting, not work: it has no cycle time.

The instrumentation wraps the engine's own bound methods (`scheduler.schedule`,
`runner.execute`, `step`) and restores them on exit; it changes nothing they do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from contbatch.calibrate.fit import StepSample
from contbatch.core.outputs import SchedulerOutput
from contbatch.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class LoopStep:
    out: SchedulerOutput
    execute_ms: float  # the runner's time
    cycle_ms: float | None  # start of this step to the start of the next; None before an idle wait

    def scaled(self, factor: float) -> LoopStep:
        """The step with its times multiplied by `factor` (brought to another machine speed)."""
        cycle = None if self.cycle_ms is None else self.cycle_ms * factor
        return LoopStep(self.out, self.execute_ms * factor, cycle)

    def sample(self) -> StepSample:
        """The step as a `StepSample` of its cycle time (only for steps that have one)."""
        if self.cycle_ms is None:
            raise ValueError("a step followed by an idle wait has no cycle time")
        out = self.out
        return StepSample(
            out.num_prefill_tokens, out.num_decode_tokens, out.num_context_tokens, out.num_requests, self.cycle_ms
        )


class StepRecorder:
    """`with StepRecorder(engine) as recorder: ...` then `recorder.steps()`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # per engine.step() call: (start, output or None for an empty step, execute s, busy after)
        self._calls: list[tuple[float, SchedulerOutput | None, float, bool]] = []
        self._out: SchedulerOutput | None = None
        self._execute_s = 0.0

    def __enter__(self) -> StepRecorder:
        engine = self.engine
        schedule, execute, step = engine.scheduler.schedule, engine.runner.execute, engine.step

        def timed_schedule(now: float) -> SchedulerOutput:
            self._out = out = schedule(now)
            return out

        def timed_execute(out: SchedulerOutput, seqs: Any) -> Any:
            start = time.perf_counter()
            try:
                return execute(out, seqs)
            finally:
                self._execute_s = time.perf_counter() - start

        def timed_step() -> Any:
            start = time.perf_counter()
            self._out, self._execute_s = None, 0.0
            outputs = step()
            out = self._out if self._out is not None and not self._out.is_empty else None
            self._calls.append((start, out, self._execute_s, engine.has_unfinished()))
            return outputs

        setattr(engine.scheduler, "schedule", timed_schedule)  # noqa: B010 - an instance attribute shadows the method
        setattr(engine.runner, "execute", timed_execute)  # noqa: B010
        setattr(engine, "step", timed_step)  # noqa: B010
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for owner, name in (
            (self.engine.scheduler, "schedule"),
            (self.engine.runner, "execute"),
            (self.engine, "step"),
        ):
            vars(owner).pop(name, None)

    def steps(self) -> list[LoopStep]:
        """Every non-empty step recorded so far, in order."""
        found: list[LoopStep] = []
        for i, (start, out, execute_s, busy) in enumerate(self._calls):
            if out is None:
                continue
            following = self._calls[i + 1][0] if i + 1 < len(self._calls) else None
            cycle = 1000.0 * (following - start) if busy and following is not None else None
            found.append(LoopStep(out, 1000.0 * execute_s, cycle))
        return found
