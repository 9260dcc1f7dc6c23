"""What the loop tells the world about its steps: a `StepRecord` per step for `StepObserver`s,
and the running `StepTotals`.

Every step taken is reported, one record each, whether the loop stepped it or the simulator
took it inside a decode run (which reports the same records stepping would: the equivalence
test compares them). A record's `out` is the step's shape: a decode run's steady decodes are
omitted from `out.chunks` and counted in `out.num_omitted_decodes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from mypy_extensions import mypyc_attr

from contbatch.core.outputs import SchedulerOutput
from contbatch.core.request import Request

if TYPE_CHECKING:
    from contbatch.loop.core import RequestOutput


class StepRecord(NamedTuple):
    out: SchedulerOutput  # the step's shape: batch size, tokens, context, padding, preemptions
    start_ts: float  # the loop's clock
    end_ts: float
    kv_usage: float  # fraction of KV blocks in use while the step ran, in [0, 1] (0 without a KV limit)
    num_sampled_tokens: int  # output tokens sampled (kept or not)


@mypyc_attr(allow_interpreted_subclasses=True)
class StepObserver:
    """Receives every step and every finished request, on the loop's thread; both do nothing
    unless overridden. An observer that raises is logged and ignored."""

    def on_step(self, record: StepRecord) -> None:
        """A step ended (its result applied)."""

    def on_finished(self, request: Request, final: RequestOutput) -> None:
        """A request the loop produces outputs for ended, after its final output `final`: the
        request's timeline gives its latencies, `final.finish_reason` the reason its client saw
        (it differs from the scheduler's when the loop ended it: a stop string on its last
        token, a failure while producing its text)."""


@dataclass(slots=True)
class StepTotals:
    """Run-level sums over the steps taken."""

    num_steps: int = 0
    busy_time: float = 0.0  # sum of step durations (the clock's unit)
    num_padding_tokens: int = 0  # token-work computed for no request
    kv_area: float = 0.0  # sum of KV usage x step duration
    kv_max: float = 0.0  # largest KV usage while a step ran
    num_failed_steps: int = 0  # steps whose executor raised
    num_output_tokens: int = 0  # output tokens delivered to requests with outputs (the engine's, the server's)

    def add(self, out: SchedulerOutput, start: float, end: float, kv_usage: float) -> None:
        self.add_step(end - start, out.num_padding_tokens, kv_usage)

    def add_step(self, duration: float, num_padding_tokens: int, kv_usage: float) -> None:
        self.num_steps += 1
        self.busy_time += duration
        self.num_padding_tokens += num_padding_tokens
        self.kv_area += kv_usage * duration
        self.kv_max = max(self.kv_max, kv_usage)

    @property
    def kv_usage_mean(self) -> float:
        """KV usage weighted by step time (0.0 before any step took time)."""
        return self.kv_area / self.busy_time if self.busy_time else 0.0
