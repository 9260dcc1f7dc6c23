"""Step times of a real engine run: what the engine loop spends per step, runner included.

`StepRecorder` observes one `LLMEngine`'s step loop for the length of a `with` block (it joins
the loop's observers and times the loop's executor): it records, per non-empty step, the
scheduler's `SchedulerOutput`, the executor's time and the step's *cycle* time, from the start
of this step to the start of the next. The cycle is what the simulator's clock advances by per
step (the next schedule happens when the previous step's results are applied and the loop has
taken in new arrivals). A step after which the engine had nothing left to run is followed by
idle waiting, not work: it has no cycle time.

On exit the loop is as it was (observer and executor restored); nothing it does changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType

from contbatch.calibrate.fit import StepSample
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.engine.llm_engine import LLMEngine
from contbatch.loop import Executor, StepObserver, StepRecord


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


class _TimedExecutor:
    """The loop's executor, timed (perf_counter seconds of its last `execute`)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.last_s = 0.0

    def execute(self, out: SchedulerOutput) -> StepResult:
        start = time.perf_counter()
        try:
            return self.inner.execute(out)
        finally:
            self.last_s = time.perf_counter() - start


class StepRecorder(StepObserver):
    """`with StepRecorder(engine) as recorder: ...` then `recorder.steps()`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._timed = _TimedExecutor(engine.core.executor)
        # per step: (output, start, execute s, busy after)
        self._records: list[tuple[SchedulerOutput, float, float, bool]] = []

    def __enter__(self) -> StepRecorder:
        core = self.engine.core
        core.executor = self._timed
        core.observers.append(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        core = self.engine.core
        core.executor = self._timed.inner
        core.observers.remove(self)

    def on_step(self, record: StepRecord) -> None:
        self._records.append((record.out, record.start_ts, self._timed.last_s, self.engine.has_unfinished()))

    def steps(self) -> list[LoopStep]:
        """Every step recorded so far, in order."""
        found: list[LoopStep] = []
        records = self._records
        for i, (out, start, execute_s, busy) in enumerate(records):
            following = records[i + 1][1] if i + 1 < len(records) else None
            cycle = 1000.0 * (following - start) if busy and following is not None else None
            found.append(LoopStep(out, 1000.0 * execute_s, cycle))
        return found
