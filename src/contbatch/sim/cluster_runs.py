"""Decode runs inside a fleet: a replica whose coming steps are foregone takes them through a
`contbatch.sim.decode_run.DecodeRun`, one step per fleet event, at O(1) cost per step instead
of a `schedule`/`update` over every running request.

The single-replica simulator takes a run's steps in bulk up to its next arrival. In a fleet any
arrival may be routed to any replica, and routers read every replica's state when they decide.
Here a run plans its steps on the fleet's clock: one step admitting the requests that wait, or
a segment of steady decodes up to the next step at which a member finishes (nothing in it is
visible to a router but its KV usage, which `scrape` reads off the plan), priced up front and
committed when its last step ends, so requests a run finishes end at their step's end. A run
whose members have all finished stays open, dormant, until a request is routed to it. A
request routed to the replica meanwhile `cut`s the segment: the steps already over are taken,
the one running stays planned, and at its end the request is admitted inside the run when it
fits (`DecodeRun.plan_step`: a step planned whole, with its prefill chunks, or the preemptions
of a KV shortage, swaps included); when a step would need a decision the run does not take (a
request whose KV arrives from elsewhere), or nothing is left to run, the run closes and the
scheduler decides again (stepping). While a run is open the scheduler's running set is stale:
what `/metrics` would show comes from the run (`scrape`).

Equivalence: the same timelines, finish reasons, step counts and KV figures as stepping
(`tests/fleet/test_cluster_runs.py`, on random fleets and traces).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from contbatch.core.outputs import SchedulerOutput
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.loop import VirtualClock
from contbatch.loop.observe import StepTotals
from contbatch.routing import Scrape
from contbatch.sim.cost import CostModel
from contbatch.sim.decode_run import DecodeRun, Segment, open_run
from contbatch.sim.executor import SimExecutor
from contbatch.sim.skip_ahead import decode_shape

MAX_RUN_STEPS = 1 << 15  # a run closes (and may reopen at once) after this many steps: bounds its step list
SEGMENT_STEPS = 64  # decode steps planned at once (fewer when a request finishes or the KV runs short sooner)

Price = Callable[[int, int], float]  # (step id, context tokens) -> the time of a step of steady decodes


class DecodePrices:
    """Prices of steady-decode steps for one cost model: its `decode_pricer` (memoized per batch
    shape) or `step_time` of the step's shape."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._make = getattr(cost, "decode_pricer", None)
        self._known: dict[tuple[int, int], Price] = {}

    def __call__(self, num_decodes: int, num_padding: int) -> Price:
        key = (num_decodes, num_padding)
        price = self._known.get(key)
        if price is None:
            made = self._make(num_decodes, num_padding) if self._make is not None else None
            if made is None:
                step_time = self.cost.step_time

                def made(step_id: int, context: int) -> float:
                    return step_time(decode_shape(step_id, num_decodes, context, num_padding))

            price = self._known[key] = made
        return price


class ReplicaRun:
    """One replica's open decode run and the steps it has planned: one step that admits waiting
    requests, or a segment of steady-decode steps up to its next finish (at most
    `segment_steps`), priced up front; the fleet hears of it once, at the last planned end."""

    def __init__(
        self, run: DecodeRun, scheduler: ContinuousScheduler, clock: VirtualClock, prices: DecodePrices,
        segment_steps: int,
    ) -> None:  # fmt: skip
        self.run = run
        self.scheduler = scheduler
        self.clock = clock
        self.prices = prices
        self.segment_steps = segment_steps
        self.total_blocks = run.ff.num_blocks or 1
        self._segment: Segment | None = None
        self._admitting: SchedulerOutput | None = None
        self.start_ts = 0.0  # the first planned step's start
        self._ends: list[float] = []  # every planned step's end
        self._used: list[int] = []  # KV blocks in use while each planned step runs
        self.num_running = 0  # while the planned steps run

    @staticmethod
    def open(
        scheduler: ContinuousScheduler, executor: SimExecutor, clock: VirtualClock, prices: DecodePrices,
        segment_steps: int = SEGMENT_STEPS,
    ) -> ReplicaRun | None:  # fmt: skip
        """A run over the scheduler's coming steps, when they are foregone and arrivals may join it."""
        ff = scheduler.fast_forward()
        if ff is None or not ff.admits_arrivals:
            return None
        run = open_run(ff, executor.stop_after, admits_arrivals=True)
        return ReplicaRun(run, scheduler, clock, prices, segment_steps)

    @property
    def num_steps(self) -> int:
        """Steps taken (committed) so far."""
        return len(self.run.step_ts)

    @property
    def end_ts(self) -> float:
        return self._ends[-1]

    @property
    def planned(self) -> bool:
        """Steps are planned (else the run is dormant: nothing runs, nothing waits)."""
        return bool(self._ends)

    @property
    def is_empty(self) -> bool:
        """No member left and nobody waiting: the run may stay open, dormant, until a request comes."""
        return self.run.num_running == 0 and not self.scheduler.num_waiting

    def plan(self, now: float) -> float | None:
        """Plan the next steps, from `now`: one with the waiting requests admitted into it, or a
        segment of decodes; the last one's end, or None when the run cannot go on (close it)."""
        run = self.run
        room = MAX_RUN_STEPS - len(run.step_ts)
        if room <= 0:
            return None
        self.start_ts = now
        segment = None if run.needs_planning() else run.decode_segment(min(room, self.segment_steps))
        if segment is None:  # admissions, a prefill chunk, or a member that cannot grow (a preemption)
            planned = run.plan_step(now)
            if planned is None:
                return None
            shape = run.take(planned, now)
            self._admitting, self._segment = shape, None
            self.num_running = run.num_running
            self._ends, self._used = [now + self.clock.pricer.step_time(shape)], [planned.used]
            return self._ends[0]
        self._segment, self._admitting = segment, None
        self.num_running = run.num_running
        price = self.prices(segment.num_decodes, segment.num_padding)
        step_id, context, n = run.first_step_id + len(run.step_ts), segment.first_context, segment.num_decodes
        ends: list[float] = []
        append = ends.append
        ts = now
        for i in range(len(segment.blocks_in_use)):
            ts += price(step_id + i, context + i * n)
            append(ts)
        self._ends, self._used = ends, segment.blocks_in_use
        return ts

    def commit(self, totals: StepTotals) -> None:
        """Take every planned step (the last one ends now): tokens, ends, the totals."""
        self._add_totals(totals, len(self._ends))
        self.clock.advance_to(self._ends[-1])
        if self._admitting is not None:
            self.run.commit(self._ends[0])
        else:
            assert self._segment is not None
            self.run.commit_segment(self._segment, self._ends)
        self._segment = self._admitting = None
        self._ends, self._used = [], []

    def _add_totals(self, totals: StepTotals, count: int) -> None:
        """Count the first `count` planned steps, one by one, in order (the sums `add_step`
        makes, step by step: equal floats)."""
        if not count:
            return
        padding = self._admitting.num_padding_tokens if self._admitting is not None else 0
        if self._segment is not None:
            padding = self._segment.num_padding
        start, total = self.start_ts, self.total_blocks
        busy, area = totals.busy_time, totals.kv_area
        ends, used = self._ends, self._used
        for i in range(count):
            end = ends[i]
            took = end - start
            busy += took
            area += used[i] / total * took
            start = end
        totals.busy_time, totals.kv_area = busy, area
        # (dividing by the same positive number keeps the order: the largest usage is the largest's)
        totals.kv_max = max(totals.kv_max, max(used[:count]) / total)
        totals.num_steps += count
        totals.num_padding_tokens += padding * count

    def cut(self, now: float, totals: StepTotals) -> float | None:
        """A request joins at the next step boundary after `now`: take the planned steps ended by
        `now`, keep planned only the one running at `now`; its end when that moved the last
        planned end (None when it did not)."""
        ends, segment = self._ends, self._segment
        if segment is None:
            return None
        j = bisect.bisect_right(ends, now)  # the step running at `now` (one ending at `now` is over)
        if j >= len(ends) - 1:
            return None
        if j:
            self._add_totals(totals, j)
            self.run.commit_segment(segment, ends[:j])
            self.start_ts = ends[j - 1]
        rest = self.run.decode_segment(1)  # the running step, as planned
        assert rest is not None and rest.blocks_in_use[0] == self._used[j], "a cut segment changed its step"
        self._segment, self._ends, self._used = rest, [ends[j]], rest.blocks_in_use
        return ends[j]

    def close(self) -> None:
        """Hand the scheduler back (nothing planned)."""
        assert not self.planned, "close with steps planned"
        self.run.close()

    def scrape(self, now: float) -> Scrape:
        """What /metrics shows at `now`, while the planned steps run (or while dormant)."""
        if not self.planned:  # no member: the pool holds exactly what it shows
            return Scrape(now, self.scheduler.num_waiting, 0, self.scheduler.kv_usage)
        j = min(bisect.bisect_right(self._ends, now), len(self._ends) - 1)
        return Scrape(now, self.scheduler.num_waiting, self.num_running, self._used[j] / self.total_blocks)
