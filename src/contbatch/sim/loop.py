"""The simulator: a trace replayed through a scheduler, each step priced by a cost model.

One loop, the same three calls as the real engine (DESIGN.md section 2)::

    out = scheduler.schedule(now); result = executor.execute(out)
    now += cost.step_time(out); scheduler.update(out, result, now)

Events are arrivals, step ends, client cancellations, client reads and the scheduler's own
timers (timeouts). Arrivals are handed to the scheduler at the first step boundary at or after
their time (a running step is never interrupted); their timelines keep the trace's arrival
time. A cancellation during a step takes effect before that step's results are applied (so
its KV is freed in that step and its last tokens reach nobody), stamped with its own time.
Clients read at their trace's `read_rate` (`contbatch.sim.clients`), which is what output
credits wait for. When nothing can run, the clock jumps to the next event.

The simulated requests reserve for the trace's output limit (`max_tokens`) and stop at its
output length (`contbatch.sim.executor`). With a KV budget, requests of one prefix group share
the hashes of their common full prompt blocks, so prefix caching can reuse them.

Invariants: the clock never goes back; a run ends only when every trace request has finished,
with exactly one reason; a scheduler that makes no progress with work pending raises
`SimulationStalled` instead of looping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from contbatch.core.base import SchedulerBase
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.core.request import Request
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.core.span import DecodeRun, may_run, open_run
from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, StreamingSummary, summarize
from contbatch.sim.clients import Clients
from contbatch.sim.cost import CostModel
from contbatch.sim.executor import DUMMY_TOKEN_ID, SimExecutor
from contbatch.traces import Trace, TraceRequest


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
    kv_usage_mean: float = 0.0  # fraction of KV blocks in use, weighted by step time
    kv_usage_max: float = 0.0
    scheduler_stats: dict[str, object] = field(default_factory=dict)  # SchedulerStats.as_dict()
    unsent_tokens: int = 0  # generated but never taken by a client (cancelled, timed out, failed)
    streaming: StreamingSummary | None = None  # with keep_timelines=False: the folded requests (timelines is empty)
    max_buffered_tokens: int = 0  # most tokens waiting for one slow client at once (0 when untracked)

    def summary(self, slo: SLO | None = None) -> dict[str, object]:
        """`contbatch.metrics.summarize` of the run (from the folded rows in streaming mode)."""
        waste = {"padding_tokens": self.padding_tokens, "unsent_tokens": self.unsent_tokens}
        if self.streaming is not None:
            return self.streaming.summary(time_unit=self.time_unit, slo=slo, **waste)
        return summarize(self.timelines, time_unit=self.time_unit, slo=slo, **waste)

    def run_stats(self) -> dict[str, object]:
        """Step-level figures timelines cannot show, JSON-ready."""
        if self.streaming is not None:
            generated = sum(row.num_output_tokens for row in self.streaming.rows)
        else:
            generated = sum(t.num_output_tokens for t in self.timelines)
        return {
            "num_steps": self.num_steps,
            "busy_time": self.busy_time,
            "kv_usage_mean": self.kv_usage_mean,
            "kv_usage_max": self.kv_usage_max,
            **self.scheduler_stats,
            "generated_tokens": generated,
            "sent_tokens": generated - self.unsent_tokens,
            "num_unsent_tokens": self.unsent_tokens,
            "max_buffered_tokens": self.max_buffered_tokens,
        }


def execute(out: SchedulerOutput) -> StepResult:
    """The simplest executor: one dummy token for every chunk that samples, never a stop."""
    return StepResult(sampled_token_ids={c.request_id: (DUMMY_TOKEN_ID,) for c in out.chunks if c.samples})


def block_hashes(spec: TraceRequest, block_size: int) -> tuple[int, ...]:
    """One hash per full prompt block: shared within a prefix group for blocks wholly inside the
    shared prefix, unique to the request otherwise."""
    num_shared = spec.prefix_tokens // block_size if spec.prefix_group is not None else 0
    return tuple(
        hash(("prefix", spec.prefix_group, i)) if i < num_shared else hash(("own", spec.request_id, i))
        for i in range(spec.num_prompt_tokens // block_size)
    )


def make_request(spec: TraceRequest, block_size: int | None = None) -> Request:
    """The scheduler's request for `spec`; with `block_size`, its prompt block hashes (for
    prefix caching)."""
    return Request(
        spec.request_id,
        spec.arrival_ts,
        spec.num_prompt_tokens,
        spec.output_limit,
        priority=spec.priority,
        tenant=spec.tenant,
        deadline_ts=spec.deadline_ts,
        block_hashes=block_hashes(spec, block_size) if block_size else (),
    )


StepHook = Callable[[SchedulerBase, SchedulerOutput, float], None]


@dataclass(slots=True)
class _Clock:
    """The loop's running totals."""

    now: float
    num_steps: int = 0
    padding: int = 0
    busy: float = 0.0
    kv_area: float = 0.0
    kv_max: float = 0.0

    def step(self, duration: float, num_padding_tokens: int, kv_usage: float) -> None:
        self.now += duration
        self.busy += duration
        self.num_steps += 1
        self.padding += num_padding_tokens
        self.kv_area += kv_usage * duration
        self.kv_max = max(self.kv_max, kv_usage)


class _Arrivals:
    """The trace's requests, made when due (streaming) or up front, handed to the scheduler in
    arrival order. Invariant: `num_added` only grows; a request is made once."""

    def __init__(self, pending: tuple[TraceRequest, ...], block_size: int | None, folder: _Folder | None) -> None:
        self.pending = pending
        self.block_size = block_size
        self.folder = folder
        self.made = [make_request(spec, block_size) for spec in pending] if folder is None else []
        self.num_added = 0
        self._due: list[Request] = []  # streaming: made, not added yet

    def next_ts(self) -> float | None:
        return self.pending[self.num_added].arrival_ts if self.num_added < len(self.pending) else None

    def due(self, now: float) -> list[Request]:
        """The requests due by `now` not handed over yet, in arrival order."""
        pending, k = self.pending, self.num_added
        end = k
        while end < len(pending) and pending[end].arrival_ts <= now:
            end += 1
        if self.folder is None:
            return self.made[k:end]
        while len(self._due) < end - k:
            self._due.append(self.folder.create(pending[k + len(self._due)], self.block_size))
        return self._due[: end - k]

    def added(self, count: int) -> None:
        self.num_added += count
        if self.folder is not None:
            del self._due[:count]


def simulate(
    trace: Trace,
    scheduler: SchedulerBase,
    cost: CostModel,
    *,
    acceptance_rate: float = 1.0,
    seed: int = 0,
    on_step: StepHook | None = None,
    skip_ahead: bool = True,
    keep_timelines: bool = True,
) -> SimResult:
    """Replay `trace` through `scheduler`, pricing steps with `cost`. Speculative drafts are
    accepted with `acceptance_rate` (draws seeded by `seed`). `on_step(scheduler, out, now)`
    runs after every update (tests check invariants there; after a decode run it runs once).
    `skip_ahead` takes the steps whose decisions are foregone as decode runs
    (`contbatch.core.span`: steady decoding, arrivals that fit, completions) at a cost per
    event rather than per request and step, with the same results as stepping through them.
    `keep_timelines=False` is the streaming mode for very large traces: requests are created
    at arrival and folded into a `StreamingSummary` once finished (no client cancellations or
    read rates then)."""
    pending = trace.requests
    kv = scheduler.config.kv
    block_size = kv.block_size if kv is not None and kv.enable_prefix_caching else None
    streaming = None if keep_timelines else _Folder(pending)
    arrivals = _Arrivals(pending, block_size, streaming)
    requests = arrivals.made
    stops = {s.request_id: s.num_output_tokens for s in pending if s.num_output_tokens < s.output_limit}
    executor = SimExecutor(stops, acceptance_rate=acceptance_rate, seed=seed)
    lifecycle = scheduler.config.lifecycle
    # reads matter when tokens can be left unsent: credits, or requests ended by a timeout
    clients = Clients(pending, requests, track_reads=lifecycle.output_credits is not None or lifecycle.has_timeouts)
    clock = _Clock(pending[0].arrival_ts if pending else 0.0)
    pricers = _Pricers(cost)
    while True:
        due = arrivals.due(clock.now)
        for request in due:
            scheduler.add_request(request, clock.now)
        arrivals.added(len(due))
        clients.cancel_due(scheduler, clock.now, arrivals.num_added)
        clients.read(scheduler, clock.now)
        out = scheduler.schedule(clock.now) if scheduler.has_unfinished() else None
        if out is None or out.is_empty:
            wake = _next_event(arrivals, clients, scheduler)
            if wake is None or wake <= clock.now:  # everything due by now was handled: nothing can change
                if scheduler.has_unfinished():
                    raise SimulationStalled(f"{scheduler.name} scheduled nothing at {clock.now} with work pending")
                break
            clock.now = max(clock.now, wake)
            continue
        result = executor.execute(out)
        duration = cost.step_time(out)
        clock.step(duration, out.num_padding_tokens, scheduler.kv_usage)
        clients.cancel_due(scheduler, clock.now, arrivals.num_added)
        scheduler.update(out, result, clock.now)
        if streaming is not None:
            streaming.fold(clock.num_steps)
        if on_step is not None:
            on_step(scheduler, out, clock.now)
        if (
            skip_ahead
            and isinstance(scheduler, ContinuousScheduler)
            and may_run(scheduler)  # O(1): most steps cannot start a run
            and not clients.reads_slowly(scheduler.running)
        ):
            _decode_run(scheduler, executor, pricers, clock, arrivals=arrivals, clients=clients, on_step=on_step)
    return _result(scheduler, cost, requests=requests, clock=clock, clients=clients, streaming=streaming)


class _Folder:
    """Streaming mode: requests made at arrival, folded into a summary once finished."""

    FOLD_EVERY = 1024  # steps between sweeps of the live requests

    def __init__(self, pending: tuple[TraceRequest, ...]) -> None:
        if any(r.cancel_ts is not None or r.read_rate is not None for r in pending):
            raise ValueError("streaming mode (keep_timelines=False) does not model client cancellations or read rates")
        self.live: list[Request] = []
        self.summary = StreamingSummary()
        self._next_fold = self.FOLD_EVERY

    def create(self, spec: TraceRequest, block_size: int | None) -> Request:
        request = make_request(spec, block_size)
        self.live.append(request)
        return request

    def fold(self, num_steps: int, *, everything: bool = False) -> None:
        if num_steps < self._next_fold and not everything:
            return
        self._next_fold = num_steps + self.FOLD_EVERY
        still: list[Request] = []
        for request in self.live:
            if request.is_finished:
                self.summary.add(request.timeline)
            else:
                still.append(request)
        self.live = still


RUN_STEPS = 1024  # the most steps one decode run takes: bounds its step-time list and, in streaming mode, how
# many finished requests wait to be folded (every 1,024 steps, as outside runs)


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


def _decode_run(
    scheduler: ContinuousScheduler,
    executor: SimExecutor,
    pricers: _Pricers,
    clock: _Clock,
    *,
    arrivals: _Arrivals,
    clients: Clients,
    on_step: StepHook | None,
) -> None:
    """Take the coming steps as a decode run (`contbatch.core.span`) for as long as it lasts:
    arrivals that fit are admitted inside it, unless clients are tracked (then it stops at the
    next arrival); it never runs through a step during which a client cancels (that step's
    results must see the cancellation)."""
    run = open_run(scheduler, executor.stop_after, admits_arrivals=not clients.track_reads)
    if run is None:
        return
    driver = _RunDriver(run, pricers, clock, arrivals, clients.next_cancel_ts())
    while driver.taken < RUN_STEPS and driver.advance():
        pass
    run.close()
    if on_step is not None and driver.taken:
        last = driver.last
        step_id = run.first_step_id + driver.taken - 1
        on_step(scheduler, last if isinstance(last, SchedulerOutput) else decode_shape(step_id, *last), clock.now)


class _RunDriver:
    """Prices and times the steps of one decode run on the simulator's clock."""

    def __init__(
        self, run: DecodeRun, pricers: _Pricers, clock: _Clock, arrivals: _Arrivals, cancel_ts: float | None
    ) -> None:
        self.run = run
        self.pricers = pricers
        self.clock = clock
        self.arrivals = arrivals
        self.cancel_ts = cancel_ts  # a step overlapping it is not the run's
        memory = run.scheduler.memory
        self.total_blocks = memory.kv.num_blocks if memory is not None else 1
        self.next_arrival = arrivals.next_ts()
        self.taken = 0
        self.duration = 0.0  # the last step's
        # the last step: its shape, or a decode step's (decodes, context, padding)
        self.last: SchedulerOutput | tuple[int, int, int] = (0, 0, 0)

    def advance(self) -> bool:
        """Take the next step(s); False when the run must end."""
        if self.next_arrival is not None and self.clock.now >= self.next_arrival:
            return self._arrival_step()
        return self._segment()

    def _arrival_step(self) -> bool:
        if not self.run.admits_arrivals:
            return False
        due = self.arrivals.due(self.clock.now)
        for request in due:  # handed over as the loop would (rejections happen here)
            self.run.scheduler.add_request(request, self.clock.now)
        self.arrivals.added(len(due))
        self.next_arrival = self.arrivals.next_ts()
        planned = self.run.admit_step(self.clock.now)
        if planned is None:
            return False
        shape, used = planned
        self.last = shape
        self.duration = self.pricers.cost.step_time(shape)
        self.clock.step(self.duration, shape.num_padding_tokens, used / self.total_blocks)
        self.run.commit(self.clock.now)
        self.taken += 1
        return True

    def _segment(self) -> bool:
        limit = RUN_STEPS - self.taken
        segment = self.run.decode_segment(_segment_steps(self.next_arrival, self.clock.now, self.duration, limit))
        if segment is None:
            return False
        n, context, padding = segment.num_decodes, segment.first_context, segment.num_padding
        price = self.pricers.for_decodes(n, padding)
        clock, next_arrival, cancel_ts = self.clock, self.next_arrival, self.cancel_ts
        first_id = self.run.first_step_id + self.taken
        ends: list[float] = []
        for used in segment.blocks_in_use:
            if next_arrival is not None and clock.now >= next_arrival:
                break
            duration = price(first_id + len(ends), context)
            if cancel_ts is not None and clock.now + duration >= cancel_ts:
                self.run.commit_segment(segment, ends)
                self.taken += len(ends)
                return False
            clock.step(duration, padding, used / self.total_blocks)
            ends.append(clock.now)
            self.duration, self.last = duration, (n, context, padding)
            context += n
        self.run.commit_segment(segment, ends)
        self.taken += len(ends)
        return True


def _segment_steps(next_arrival: float | None, now: float, last_duration: float, limit: int) -> int:
    """How many decode steps to plan before the next arrival: an overestimate (steps only get
    cheaper as the batch shrinks), never more than `limit`."""
    if next_arrival is None or last_duration <= 0:
        return limit if next_arrival is None else min(limit, 16)
    return min(limit, int((next_arrival - now) / last_duration * 1.25) + 2)


def _next_event(arrivals: _Arrivals, clients: Clients, scheduler: SchedulerBase) -> float | None:
    """The earliest future event that may let an idle scheduler run again."""
    times = [arrivals.next_ts(), clients.next_cancel_ts(), clients.next_read_ts(scheduler), scheduler.next_timer()]
    found = [t for t in times if t is not None]
    return min(found) if found else None


def _result(
    scheduler: SchedulerBase,
    cost: CostModel,
    *,
    requests: list[Request],
    clock: _Clock,
    clients: Clients,
    streaming: _Folder | None,
) -> SimResult:
    busy = clock.busy or 1.0
    if streaming is not None:
        streaming.fold(clock.num_steps, everything=True)
    return SimResult(
        scheduler=scheduler.name,
        time_unit=cost.time_unit,
        timelines=tuple(r.timeline for r in requests),
        num_steps=clock.num_steps,
        padding_tokens=clock.padding,
        busy_time=clock.busy,
        kv_usage_mean=clock.kv_area / busy,
        kv_usage_max=clock.kv_max,
        scheduler_stats=scheduler.stats.as_dict(),
        unsent_tokens=scheduler.stats.num_unsent_tokens + clients.late_waste,
        max_buffered_tokens=clients.max_buffered,
        streaming=streaming.summary if streaming is not None else None,
    )
