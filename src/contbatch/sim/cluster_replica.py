"""One replica of a simulated fleet, and a routing group of them.

A `Replica` is its own step loop (`EngineCore`: scheduler, KV cache, `SimExecutor`) on its own
`VirtualClock`, moved to the fleet's shared time whenever it starts a step. Its life:
PROVISIONING (billed, not serving) → READY (routable) → DRAINING (finishes what it has, takes
nothing new) → STOPPED. It keeps the requests it holds (`live`) so that the fleet learns of every
end, whichever way it came (a step's results, a timeout found by `schedule`, a failed step), and
a short history of what its `/metrics` would show, for routers and autoscalers that read
delayed scrapes.

A `Group` is the replicas of one role (mixed, prefill or decode) behind one router, with the
gateway's own accounting of them (`contbatch.routing.LoadTracker`).

Invariants: `live` holds exactly the scheduler's unfinished requests after every `collect`;
a STOPPED replica holds nothing; only READY replicas are in their group's routable list; a
replica runs at most one step at a time, stepped (`flight`) or in a decode run (`run`).
"""

from __future__ import annotations

import bisect
import enum

from contbatch.core import Request, make_scheduler
from contbatch.core.outputs import AddDecision
from contbatch.loop import EngineCore, Flight, VirtualClock
from contbatch.routing import LoadTracker, ReplicaView, Router, RouteRequest, Scrape
from contbatch.sim.cluster_config import PoolSpec
from contbatch.sim.cluster_runs import ReplicaRun
from contbatch.sim.executor import SimExecutor


class ReplicaState(enum.Enum):
    PROVISIONING = "provisioning"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


class Replica:
    __slots__ = (
        "clock",
        "core",
        "event_seq",
        "executor",
        "flight",
        "history",
        "history_ts",
        "incoming",
        "index",
        "live",
        "num_routed",
        "pool",
        "ready_ts",
        "replica_id",
        "run",
        "scheduler",
        "start_ts",
        "state",
        "stop_ts",
    )

    def __init__(self, replica_id: str, index: int, pool: PoolSpec, start_ts: float, *, keep_history: bool) -> None:
        self.replica_id = replica_id
        self.index = index  # creation order across the fleet (event tie-breaks)
        self.pool = pool
        self.scheduler = make_scheduler(pool.scheduler, pool.config)
        self.clock = VirtualClock(pool.cost, start_ts)
        self.executor = SimExecutor({})
        self.core = EngineCore(self.scheduler, self.executor, self.clock)
        self.flight: Flight | None = None
        self.event_seq = 0  # the fleet's event for the end of its running step (others are stale)
        self.run: ReplicaRun | None = None  # an open decode run (contbatch.sim.cluster_runs)
        self.live: dict[str, Request] = {}
        self.state = ReplicaState.PROVISIONING
        self.start_ts = start_ts  # billed from here
        self.ready_ts: float | None = None
        self.stop_ts: float | None = None
        self.incoming = 0  # KV transfers on their way here
        self.num_routed = 0
        self.history: list[Scrape] | None = [] if keep_history else None
        self.history_ts: list[float] = []

    def __repr__(self) -> str:
        return f"Replica({self.replica_id}, {self.state.value}, live={len(self.live)})"

    # -- requests ------------------------------------------------------------------------------
    def add(self, request: Request, now: float, stop_after: int | None) -> AddDecision:
        """Hand `request` to the scheduler at `now` (between steps or while one runs: it is
        scheduled at the next step boundary); `stop_after`: its output length when it stops
        before its output limit."""
        if stop_after is not None:
            self.executor.stop_after[request.request_id] = stop_after
        decision = self.core.add_request(request, at=now)
        if decision.queued:
            self.live[request.request_id] = request
            self.num_routed += 1
            if self.history is not None:
                self.note(now)
        return decision

    def start(self, now: float) -> Flight | None:
        """Begin a step at `now` (None: nothing to run)."""
        self.clock.advance_to(now)
        self.flight = flight = self.core.begin_step()
        if self.history is not None:
            self.note(now)
        return flight

    def end(self) -> list[Request]:
        """Apply the running step's results; every request that ended since the last call."""
        flight, self.flight = self.flight, None
        assert flight is not None
        return self.collect(self.core.end_step(flight))

    def collect(self, done: list[Request]) -> list[Request]:
        """`done` (known ended) plus any other request that ended unseen, each once, out of `live`."""
        live = self.live
        ended = [r for r in done if live.pop(r.request_id, None) is not None] if done else []
        unseen = len(live) - self.scheduler.num_unfinished  # (live holds the unfinished ones)
        if unseen:
            others = []
            for request in live.values():  # in the order they came (the oldest tend to end first)
                if request.is_finished:
                    others.append(request)
                    if len(others) == unseen:
                        break
            for request in others:
                del live[request.request_id]
            ended += others
        stops = self.executor.stop_after
        if stops:
            for request in ended:
                stops.pop(request.request_id, None)
        return ended

    @property
    def busy(self) -> bool:
        """A step is running (stepped, or a decode run's)."""
        return self.flight is not None or (self.run is not None and self.run.planned)

    @property
    def is_idle(self) -> bool:
        """Nothing running, held or on its way."""
        return not self.busy and not self.live and not self.incoming

    # -- what a gateway can scrape -------------------------------------------------------------
    def scrape(self, now: float) -> Scrape:
        if self.run is not None:  # the scheduler's running set is stale while a run is open
            return self.run.scrape(now)
        s = self.scheduler
        return Scrape(now, s.num_waiting, s.num_running, s.kv_usage)

    def note(self, now: float) -> None:
        """Record what /metrics shows from `now` on."""
        history, stamps = self.history, self.history_ts
        assert history is not None
        scrape = self.scrape(now)
        if stamps and stamps[-1] == now:
            history[-1] = scrape
        else:
            history.append(scrape)
            stamps.append(now)

    def scrape_at(self, ts: float, now: float) -> Scrape | None:
        """What a scrape at `ts` (<= now) showed; None before the replica had any."""
        if self.history is None or ts >= now:
            return self.scrape(now)
        i = bisect.bisect_right(self.history_ts, ts) - 1
        return self.history[i] if i >= 0 else None

    def trim(self, ts: float) -> None:
        """Forget what no scrape at `ts` or later needs."""
        if self.history is None:
            return
        i = bisect.bisect_right(self.history_ts, ts) - 1
        if i > 64 and 2 * i > len(self.history_ts):
            del self.history[:i]
            del self.history_ts[:i]


class Group:
    """The replicas of one role behind one router."""

    def __init__(self, role: str, router: Router, signal_delay: float) -> None:
        self.role = role
        self.router = router
        self.signal_delay = signal_delay
        self.tracker = LoadTracker()
        self.routable: list[Replica] = []
        self.views: list[ReplicaView] = []
        self.members: list[Replica] = []  # every replica ever in the group, in creation order

    def add(self, replica: Replica) -> None:
        self.members.append(replica)

    def open(self, replica: Replica) -> None:
        """`replica` became READY: routable from now on."""
        view = self.tracker.add_replica(replica.replica_id)
        self.routable.append(replica)
        self.views.append(view)

    def close(self, replica: Replica) -> None:
        """`replica` stops taking new requests (draining)."""
        i = self.routable.index(replica)
        del self.routable[i]
        del self.views[i]

    def forget(self, replica: Replica) -> None:
        """`replica` stopped: its accounting goes."""
        self.tracker.remove_replica(replica.replica_id)

    def route(self, request: RouteRequest, now: float, limit: int | None = None) -> Replica:
        """Choose a routable replica for `request` (among those with fewer than `limit` requests
        in flight, when given) and count it there."""
        replicas, views = self.routable, self.views
        if limit is not None:
            room = [i for i, v in enumerate(views) if v.num_in_flight < limit]
            replicas, views = [replicas[i] for i in room], [views[i] for i in room]
        if self.router.needs_scrape:
            cutoff = now - self.signal_delay
            for replica, view in zip(replicas, views, strict=True):
                view.scrape = replica.scrape_at(cutoff, now)
        replica = replicas[self.router.choose(request, views)]
        self.tracker.routed(request, replica.replica_id)
        return replica
