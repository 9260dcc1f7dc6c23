"""The simulator: a trace replayed through a scheduler on the one step loop
(`contbatch.loop.EngineCore`) with a virtual clock priced by a cost model.

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

Skip-ahead: steps whose decisions are foregone are taken as decode runs
(`contbatch.sim.decode_run`) at a cost per event rather than per request and step, with the
same results, the same step records for observers, and the same totals as stepping.

Invariants: the clock never goes back; a run ends only when every trace request has finished,
with exactly one reason; a scheduler that makes no progress with work pending raises
`SimulationStalled` instead of looping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from contbatch.core.base import SchedulerBase
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.core.request import Request
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.core.timeline import Timeline
from contbatch.loop import EngineCore, StepObserver, VirtualClock
from contbatch.metrics import SLO, StreamingSummary, summarize
from contbatch.sim.clients import Clients
from contbatch.sim.cost import CostModel
from contbatch.sim.executor import DUMMY_TOKEN_ID, SimExecutor
from contbatch.sim.no_cycles import cyclic_gc_paused
from contbatch.sim.skip_ahead import SkipAhead
from contbatch.traces import Trace, TraceRequest


@mypyc_attr(native_class=False)  # (compiled, a class cannot derive from RuntimeError)
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

    @cyclic_gc_paused()  # (it makes no reference cycles either)
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


def make_request(spec: TraceRequest, block_size: int | None = None) -> Request:
    """The scheduler's request for `spec`; with `block_size`, its prompt block hashes (for
    prefix caching; `contbatch.loop.intake.group_block_hashes`)."""
    return Request(
        spec.request_id,
        spec.arrival_ts,
        spec.num_prompt_tokens,
        spec.output_limit,
        priority=spec.priority,
        tenant=spec.tenant,
        deadline_ts=spec.deadline_ts,
        block_hashes=_block_hashes(spec, block_size) if block_size else (),
    )


def _block_hashes(spec: TraceRequest, block_size: int) -> tuple[int, ...]:
    from contbatch.loop.intake import group_block_hashes  # (with prefix caching only: intake is otherwise unused)

    return group_block_hashes(
        spec.request_id,
        spec.num_prompt_tokens,
        block_size,
        group=spec.prefix_group,
        num_shared_tokens=spec.prefix_tokens,
    )


Inspect = Callable[[SchedulerBase, SchedulerOutput, float], None]


class Arrivals:
    """The trace's requests, made when due (streaming) or up front, handed to the scheduler in
    arrival order. Invariant: `num_added` only grows; a request is made once."""

    def __init__(self, pending: tuple[TraceRequest, ...], block_size: int | None, folder: _Folder | None) -> None:
        self.pending = pending
        self.block_size = block_size
        self.folder = folder
        self.made = [make_request(spec, block_size) for spec in pending] if folder is None else []
        self.num_added = 0

    def next_ts(self) -> float | None:
        return self.pending[self.num_added].arrival_ts if self.num_added < len(self.pending) else None

    def hand_over(self, core: EngineCore, now: float) -> None:
        """Add the requests due by `now` to the loop, in arrival order."""
        pending, k = self.pending, self.num_added
        end = k
        while end < len(pending) and pending[end].arrival_ts <= now:
            end += 1
        if end == k:
            return
        if self.folder is None:
            due = self.made[k:end]
        else:
            due = [self.folder.create(spec, self.block_size) for spec in pending[k:end]]
        for request in due:
            core.add_request(request, at=now)
        self.num_added = end


@cyclic_gc_paused()  # (it makes no reference cycles: contbatch.sim.no_cycles)
def simulate(
    trace: Trace,
    scheduler: SchedulerBase,
    cost: CostModel,
    *,
    acceptance_rate: float = 1.0,
    seed: int = 0,
    observers: Sequence[StepObserver] = (),
    inspect: Inspect | None = None,
    skip_ahead: bool = True,
    keep_timelines: bool = True,
) -> SimResult:
    """Replay `trace` through `scheduler`, pricing steps with `cost`. Speculative drafts are
    accepted with `acceptance_rate` (draws seeded by `seed`). `observers` receive a record of
    every step (`contbatch.loop.observe`). `inspect(scheduler, out, now)` runs whenever the
    scheduler's state is current: after every stepped update, and once after each decode run
    (with its last step's shape); tests check invariants there. `skip_ahead` takes the steps
    whose decisions are foregone as decode runs (`contbatch.sim.decode_run`) at a cost per
    event rather than per request and step, with the same results as stepping through them.
    `keep_timelines=False` is the streaming mode for very large traces: requests are created
    at arrival and folded into a `StreamingSummary` once finished (no client cancellations or
    read rates then)."""
    pending = trace.requests
    kv = scheduler.config.kv
    block_size = kv.block_size if kv is not None and kv.enable_prefix_caching else None
    streaming = None if keep_timelines else _Folder(pending)
    arrivals = Arrivals(pending, block_size, streaming)
    stops = {s.request_id: s.num_output_tokens for s in pending if s.num_output_tokens < s.output_limit}
    executor = SimExecutor(stops, acceptance_rate=acceptance_rate, seed=seed)
    lifecycle = scheduler.config.lifecycle
    # reads matter when tokens can be left unsent: credits, or requests ended by a timeout
    track_reads = lifecycle.output_credits is not None or lifecycle.has_timeouts
    clients = Clients(pending, arrivals.made, track_reads=track_reads)
    clock = VirtualClock(cost, pending[0].arrival_ts if pending else 0.0)
    core = EngineCore(scheduler, executor, clock, observers=observers)
    skipping = SkipAhead(core, clock, executor, arrivals, clients) if skip_ahead else None
    while True:
        now = clock.now()
        arrivals.hand_over(core, now)
        clients.cancel_due(core, now, arrivals.num_added)
        clients.read(core, now)
        flight = core.begin_step() if scheduler.has_unfinished() else None
        if flight is None:
            wake = _next_event(arrivals, clients, core)
            if wake is None or wake <= now:  # everything due by now was handled: nothing can change
                if scheduler.has_unfinished():
                    raise SimulationStalled(f"{scheduler.name} scheduled nothing at {now} with work pending")
                break
            clock.advance_to(wake)
            continue
        clients.cancel_due(core, flight.end_ts, arrivals.num_added)
        core.end_step(flight)
        if streaming is not None:
            streaming.fold(core.totals.num_steps)
        if inspect is not None:
            inspect(scheduler, flight.out, flight.end_ts)
        if skipping is not None and isinstance(scheduler, ContinuousScheduler):
            skipping.run(scheduler, inspect)
    return _result(scheduler, cost, requests=arrivals.made, core=core, clients=clients, streaming=streaming)


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


def _next_event(arrivals: Arrivals, clients: Clients, core: EngineCore) -> float | None:
    """The earliest future event that may let an idle scheduler run again."""
    times = [arrivals.next_ts(), clients.next_cancel_ts(), clients.next_read_ts(core), core.next_timer()]
    found = [t for t in times if t is not None]
    return min(found) if found else None


def _result(
    scheduler: SchedulerBase,
    cost: CostModel,
    *,
    requests: list[Request],
    core: EngineCore,
    clients: Clients,
    streaming: _Folder | None,
) -> SimResult:
    totals = core.totals
    if streaming is not None:
        streaming.fold(totals.num_steps, everything=True)
    return SimResult(
        scheduler=scheduler.name,
        time_unit=cost.time_unit,
        timelines=tuple(r.timeline for r in requests),
        num_steps=totals.num_steps,
        padding_tokens=totals.num_padding_tokens,
        busy_time=totals.busy_time,
        kv_usage_mean=totals.kv_usage_mean,
        kv_usage_max=totals.kv_max,
        scheduler_stats=scheduler.stats.as_dict(),
        unsent_tokens=scheduler.stats.num_unsent_tokens + clients.late_waste,
        max_buffered_tokens=clients.max_buffered,
        streaming=streaming.summary if streaming is not None else None,
    )
