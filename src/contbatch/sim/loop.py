"""The simulator: a trace replayed through a scheduler, each step priced by a cost model.

One loop, the same three calls as the real engine (DESIGN.md section 2)::

    out = scheduler.schedule(now); result = executor.execute(out)
    now += cost.step_time(out); scheduler.update(out, result, now)

Events are arrivals and step ends. Arrivals are handed to the scheduler at the first step
boundary at or after their time (a running step is never interrupted); their timelines keep
the trace's arrival time. When nothing can run, the clock jumps to the next arrival.

Invariants: the clock never goes back; a run ends only when every trace request has finished,
with exactly one reason; a scheduler that makes no progress with work pending raises
`SimulationStalled` instead of looping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from contbatch.core.base import SchedulerBase
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.core.request import Request
from contbatch.core.timeline import Timeline
from contbatch.sim.cost import CostModel
from contbatch.traces import Trace, TraceRequest

DUMMY_TOKEN_ID = 0  # the simulator samples no real tokens


class SimulationStalled(RuntimeError):
    """The scheduler scheduled nothing while requests were pending and no arrival was left."""


@dataclass(frozen=True, slots=True)
class SimResult:
    scheduler: str
    time_unit: str  # the clock's unit: "tick" or "s"
    timelines: tuple[Timeline, ...]  # one per trace request, in trace order
    num_steps: int
    padding_tokens: int  # token-work computed for no request, over the whole run
    busy_time: float  # sum of step times (the makespan minus idle gaps)


def execute(out: SchedulerOutput) -> StepResult:
    """The simulator's executor: one dummy token for every chunk that samples."""
    return StepResult(sampled_token_ids={c.request_id: (DUMMY_TOKEN_ID,) for c in out.chunks if c.samples})


def make_request(spec: TraceRequest) -> Request:
    return Request(
        spec.request_id,
        spec.arrival_ts,
        spec.num_prompt_tokens,
        spec.num_output_tokens,
        priority=spec.priority,
        tenant=spec.tenant,
        deadline_ts=spec.deadline_ts,
    )


StepHook = Callable[[SchedulerBase, SchedulerOutput, float], None]


def simulate(trace: Trace, scheduler: SchedulerBase, cost: CostModel, *, on_step: StepHook | None = None) -> SimResult:
    """Replay `trace` through `scheduler`, pricing steps with `cost`; `on_step(scheduler, out,
    now)` runs after every update (tests check invariants there)."""
    pending = trace.requests
    requests = [make_request(spec) for spec in pending]
    now = pending[0].arrival_ts if pending else 0.0
    next_arrival = num_steps = padding = 0
    busy = 0.0
    while True:
        while next_arrival < len(requests) and pending[next_arrival].arrival_ts <= now:
            scheduler.add_request(requests[next_arrival], now)
            next_arrival += 1
        out = scheduler.schedule(now) if scheduler.has_unfinished() else None
        if out is None or out.is_empty:
            if next_arrival == len(requests):
                if scheduler.has_unfinished():
                    raise SimulationStalled(f"{type(scheduler).__name__} scheduled nothing at {now} with work pending")
                break
            now = max(now, pending[next_arrival].arrival_ts)
            continue
        result = execute(out)
        duration = cost.step_time(out)
        now += duration
        busy += duration
        num_steps += 1
        padding += out.num_padding_tokens
        scheduler.update(out, result, now)
        if on_step is not None:
            on_step(scheduler, out, now)
    return SimResult(
        scheduler=getattr(scheduler, "name", type(scheduler).__name__),
        time_unit=cost.time_unit,
        timelines=tuple(r.timeline for r in requests),
        num_steps=num_steps,
        padding_tokens=padding,
        busy_time=busy,
    )
