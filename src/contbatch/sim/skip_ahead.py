"""Skip-ahead: the simulator takes the steps whose decisions are foregone as decode runs
(`contbatch.sim.decode_run`), priced and timed here on the loop's virtual clock.

A run goes on while it can: waiting requests are admitted inside it as they fit and a prefilling
one takes its chunks (those steps planned whole, `_planned_step`), unless clients are tracked
(then it stops at the next arrival, and does not open while requests wait); it never runs
through a step during which a client cancels
(that step's results must see the cancellation); it takes at most `RUN_STEPS` steps
(`LONG_RUN_STEPS` when finished requests are kept rather than folded). Every step
it takes is added to the loop's totals and, when the loop has observers, reported as the same
`StepRecord` stepping would give.

Without observers, a long stretch of decode steps (`AT_ONCE_STEPS` or more) is timed with
vectorised arithmetic (`_timed_at_once`): the step ends and the loop's totals are sequential
sums (`np.add.accumulate`, left to right as stepping adds them), so every float equals the one
stepping gives; a `FixedPrice` pricer (the unit cost) is not even called per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from contbatch.core.outputs import SchedulerOutput
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.loop import EngineCore, StepRecord, VirtualClock
from contbatch.sim.clients import Clients
from contbatch.sim.cost import CostModel, FixedPrice
from contbatch.sim.decode_run import DecodeRun, Segment, open_run
from contbatch.sim.executor import SimExecutor

if TYPE_CHECKING:
    from contbatch.sim.loop import Arrivals, Inspect

RUN_STEPS = 1024  # the most steps one decode run takes: bounds its step-time list and, in streaming mode, how
# many finished requests wait to be folded (every 1,024 steps, as outside runs)
LONG_RUN_STEPS = 1 << 15  # the same when requests are not folded (not streaming): fewer runs to open and close
AT_ONCE_STEPS = 64  # segments this long are timed with vectorised arithmetic (when nothing observes steps)


def decode_shape(step_id: int, num_decodes: int, context: int, num_padding: int) -> SchedulerOutput:
    """The shape of a step of `num_decodes` steady decodes (chunks omitted)."""
    return SchedulerOutput(
        step_id,
        (),
        num_decodes,
        0,
        num_decodes,
        context,
        num_padding,
        num_requests=num_decodes,
        num_omitted_decodes=num_decodes,
    )


class _Pricers:
    """Step prices for decode runs: the cost model's `decode_pricer(decodes, padding)` when it
    has one (one per batch shape, kept), else `step_time` of the step's shape."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._fast: dict[tuple[int, int], Callable[[int, int], float]] = {}
        self._make = getattr(cost, "decode_pricer", None)

    def for_decodes(self, num_decodes: int, num_padding: int) -> Callable[[int, int], float]:
        """`price(step_id, context)` of a step of `num_decodes` steady decodes."""
        key = (num_decodes, num_padding)
        price = self._fast.get(key)
        if price is None:
            made = self._make(num_decodes, num_padding) if self._make is not None else None
            price = made if made is not None else self._generic(num_decodes, num_padding)
            self._fast[key] = price
        return price

    def _generic(self, num_decodes: int, num_padding: int) -> Callable[[int, int], float]:
        step_time = self.cost.step_time

        def price(step_id: int, context: int) -> float:
            return step_time(decode_shape(step_id, num_decodes, context, num_padding))

        return price


class SkipAhead:
    def __init__(
        self, core: EngineCore, clock: VirtualClock, executor: SimExecutor, arrivals: Arrivals, clients: Clients
    ) -> None:
        self.core = core
        self.clock = clock
        self.executor = executor
        self.arrivals = arrivals
        self.clients = clients
        self.pricers = _Pricers(clock.pricer)
        self.run_steps = RUN_STEPS if arrivals.folder is not None else LONG_RUN_STEPS

    def run(self, scheduler: ContinuousScheduler, inspect: Inspect | None) -> None:
        """Take the coming steps as a decode run, if they are foregone, for as long as it lasts."""
        ff = scheduler.fast_forward()
        admits = not self.clients.track_reads
        if ff is None or self.clients.reads_slowly(ff.running) or (ff.has_waiting() and not admits):
            return  # (a run that cannot admit would end at its first step)
        run = open_run(ff, self.executor.stop_after, admits_arrivals=admits)
        driver = _RunDriver(self, run)
        while driver.taken < self.run_steps and driver.advance():
            pass
        run.close()
        if inspect is not None and driver.taken:
            inspect(scheduler, driver.last_shape(), self.clock.ts)


class _RunDriver:
    """Prices and times the steps of one decode run on the loop's clock."""

    def __init__(self, skip: SkipAhead, run: DecodeRun) -> None:
        self.run = run
        self.core = skip.core
        self.clock = skip.clock
        self.pricers = skip.pricers
        self.run_steps = skip.run_steps
        self.arrivals = skip.arrivals
        self.cancel_ts = skip.clients.next_cancel_ts()  # a step overlapping it is not the run's
        self.total_blocks = run.ff.num_blocks or 1
        self.next_arrival = self.arrivals.next_ts()
        self.observed = bool(self.core.observers)
        self.taken = 0
        self.duration = 0.0  # the last step's
        # the last step: its shape, or a decode step's (decodes, context, padding)
        self.last: SchedulerOutput | tuple[int, int, int] = (0, 0, 0)

    def last_shape(self) -> SchedulerOutput:
        last = self.last
        step_id = self.run.first_step_id + self.taken - 1
        return last if isinstance(last, SchedulerOutput) else decode_shape(step_id, *last)

    def advance(self) -> bool:
        """Take the next step(s); False when the run must end."""
        if self.next_arrival is not None and self.clock.ts >= self.next_arrival:
            if not self.run.admits_arrivals:
                return False
            self.arrivals.hand_over(self.core, self.clock.ts)  # as the loop would (rejections happen here)
            self.next_arrival = self.arrivals.next_ts()
            return self._planned_step()
        if self.run.needs_planning():
            return self._planned_step()
        return self._segment()

    def _planned_step(self) -> bool:
        """One step planned whole (`DecodeRun.plan_step`): admissions, a prefill chunk, preemptions.
        A step that swaps is priced from the shape taking it gives (its block ids exist only
        then), so it is not the run's while a cancellation is pending (it could overlap it)."""
        start = self.clock.ts
        planned = self.run.plan_step(start)
        if planned is None or (planned.swaps and self.cancel_ts is not None):
            return False
        shape = self.run.take(planned, start) if planned.swaps else planned.shape
        duration = self.clock.pricer.step_time(shape)
        end = start + duration
        if not planned.swaps:
            if self.cancel_ts is not None and end >= self.cancel_ts:
                return False  # that step's results must see the cancellation: not the run's
            self.run.take(planned, start)
        self.last, self.duration = shape, duration
        self.clock.advance_to(end)
        kv_usage = planned.used / self.total_blocks
        self.core.totals.add_step(end - start, shape.num_padding_tokens, kv_usage)  # as stepping counts it
        if self.observed:
            sampled = shape.num_omitted_decodes + sum([c.samples for c in shape.chunks])
            self.core.observe(StepRecord(shape, start, end, kv_usage, sampled))
        self.run.commit(end)
        self.taken += 1
        return True

    def _segment(self) -> bool:
        limit = self.run_steps - self.taken
        segment = self.run.decode_segment(_segment_steps(self.next_arrival, self.clock.ts, self.duration, limit))
        if segment is None:  # a member cannot grow (a step planned whole preempts) or none is left
            return self._planned_step()
        n, context, padding = segment.num_decodes, segment.first_context, segment.num_padding
        price = self.pricers.for_decodes(n, padding)
        first_id = self.run.first_step_id + self.taken
        totals = self.core.totals
        if not self.observed and len(segment.blocks_in_use) >= AT_ONCE_STEPS:
            ends, cancelled, last_duration = self._timed_at_once(segment, price, first_id)
            context += n * len(ends)
        else:
            ends, cancelled, last_duration, context = self._timed(segment, price, first_id)
        if ends:
            self.duration, self.last = last_duration, (n, context - n, padding)
        self.clock.advance_to(ends[-1] if ends else self.clock.ts)
        totals.num_steps += len(ends)
        totals.num_padding_tokens += padding * len(ends)
        self.run.commit_segment(segment, ends)
        self.taken += len(ends)
        return not cancelled

    def _timed(
        self, segment: Segment, price: Callable[[int, int], float], first_id: int
    ) -> tuple[list[float], bool, float, int]:
        """Time the segment's steps one by one (reporting each to the observers) until an arrival
        is due or a step would overlap a cancellation: (their end times, whether a cancellation
        cut it, the last step's duration, the context after them); the loop's totals updated."""
        n, context, padding = segment.num_decodes, segment.first_context, segment.num_padding
        next_arrival, cancel_ts, total_blocks = self.next_arrival, self.cancel_ts, self.total_blocks
        # the totals are summed step by step, in the order stepping sums them (equal floats)
        totals = self.core.totals
        busy, area, kv_max = totals.busy_time, totals.kv_area, totals.kv_max
        now = self.clock.ts
        ends: list[float] = []
        cancelled, observed, last_duration = False, self.observed, self.duration
        step_id = first_id
        for used in segment.blocks_in_use:
            if next_arrival is not None and now >= next_arrival:
                break
            duration = price(step_id, context)
            end = now + duration
            if cancel_ts is not None and end >= cancel_ts:
                cancelled = True  # that step's results must see the cancellation: not the run's
                break
            took, usage = end - now, used / total_blocks
            busy += took
            area += usage * took
            kv_max = max(kv_max, usage)
            if observed:
                shape = decode_shape(step_id, n, context, padding)
                self.core.observe(StepRecord(shape, now, end, usage, n))
            ends.append(end)
            now, last_duration = end, duration
            context += n
            step_id += 1
        totals.busy_time, totals.kv_area, totals.kv_max = busy, area, kv_max
        return ends, cancelled, last_duration, context

    def _timed_at_once(
        self, segment: Segment, price: Callable[[int, int], float], first_id: int
    ) -> tuple[list[float], bool, float]:
        """`_timed` of an unobserved segment with vectorised arithmetic (same cut, same floats):
        (the steps' end times, whether a cancellation cut it, the last step's duration)."""
        k = len(segment.blocks_in_use)
        times = np.empty(k + 1)
        times[0] = self.clock.ts
        if isinstance(price, FixedPrice):
            times[1:] = price.value
        else:
            n, context = segment.num_decodes, segment.first_context
            times[1:] = [price(first_id + j, context + j * n) for j in range(k)]
        durations = times[1:].copy()
        np.add.accumulate(times, out=times)  # times[j]: when step j starts (step j - 1 ends)
        cut, cancelled = k, False
        if self.next_arrival is not None:  # a step starting at or after the arrival is not the run's
            late = np.flatnonzero(times[:k] >= self.next_arrival)
            cut = int(late[0]) if late.size else k
        if self.cancel_ts is not None:  # nor one ending at or after a cancellation
            overlapping = np.flatnonzero(times[1 : cut + 1] >= self.cancel_ts)
            if overlapping.size:
                cut, cancelled = int(overlapping[0]), True
        if not cut:
            return [], cancelled, self.duration
        totals = self.core.totals
        took = np.diff(times[: cut + 1])
        in_use = segment.blocks_in_use
        if in_use[0] == in_use[cut - 1]:  # (non-decreasing) no block taken in between: one usage
            usage = np.full(cut, in_use[0] / self.total_blocks)
        else:
            usage = np.asarray(in_use[:cut], dtype=np.float64) / self.total_blocks
        totals.busy_time = float(np.add.accumulate(np.concatenate(([totals.busy_time], took)))[-1])
        totals.kv_area = float(np.add.accumulate(np.concatenate(([totals.kv_area], usage * took)))[-1])
        totals.kv_max = max(totals.kv_max, float(usage.max()))
        return times[1 : cut + 1].tolist(), cancelled, float(durations[cut - 1])


def _segment_steps(next_arrival: float | None, now: float, last_duration: float, limit: int) -> int:
    """How many decode steps to plan before the next arrival: an overestimate (steps only get
    cheaper as the batch shrinks), never more than `limit`."""
    if next_arrival is None or last_duration <= 0:
        return limit if next_arrival is None else min(limit, 16)
    return min(limit, int((next_arrival - now) / last_duration * 1.25) + 2)
