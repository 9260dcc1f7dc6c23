"""The cluster simulator: N replicas on one virtual clock behind a gateway (admission, routers),
aggregated or with prefill/decode disaggregation, optionally autoscaled.

Each replica is its own step loop (`contbatch.sim.cluster_replica.Replica`: scheduler, KV
cache, cost model; pools may differ). Events, in time order (ties: step ends, KV transfers
arriving, replicas becoming ready, gateway releases, timers, then arrivals, autoscaler ticks,
samples; then the order they were made, so a run is deterministic):

- an arrival passes the gateway's admission stage (`cluster_admission`) and is routed: in an
  aggregated fleet to a `mixed` replica; in a disaggregated one to a decode replica first, and
  when its uncached prompt tokens reach the threshold, to a prefill replica too, where it runs
  as a request with output limit 1 whose end is the handoff;
- a handoff moves the prompt's KV over the link (`cluster_transfer`), then the request joins
  its decode replica's queue with the KV as external tokens (`Request.num_external_tokens`):
  the decode scheduler admits it under its own KV budget (it waits, never dropped); a request
  that could never fit there is rejected, with the scheduler's reason, before its prefill runs.
  Its fleet timeline is the decode side's with the prefill's first admission as its first
  SCHEDULED: TTFT counts the prefill, the transfer, the wait and the first decode step;
- a replica steps whenever it has work; a request handed to it during a step waits for the next
  step boundary;
- routers see the gateway's own accounting and scrapes as of `now - signal_delay`;
- autoscaler ticks add replicas (serving after the provisioning delay) or drain them.

Invariants (`check`, run after every event in the tests): every trace request ends exactly once
across the fleet; an unfinished request is in exactly one place (the gateway queue, one
replica, or a KV transfer); each replica's `live` equals its scheduler's unfinished requests;
the gateway's accounting equals the requests it routed; and (the scheduler's own invariants,
checked between steps) no replica leaks a KV block.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

from contbatch.core import ContinuousScheduler, FinishReason, Request
from contbatch.core.timeline import Timeline
from contbatch.metrics import StreamingSummary
from contbatch.routing import PrefixIndex, RouteRequest, make_router
from contbatch.routing.hashing import chain, mix64, text_hash
from contbatch.sim.autoscale import Autoscaler
from contbatch.sim.cluster_admission import AdmissionStage
from contbatch.sim.cluster_config import FleetSpec, PoolSpec
from contbatch.sim.cluster_pricing import PoolPricer, work_pricer
from contbatch.sim.cluster_replica import Group, Replica, ReplicaState
from contbatch.sim.cluster_report import Reporter
from contbatch.sim.cluster_result import ClusterResult
from contbatch.sim.cluster_runs import SEGMENT_STEPS, DecodePrices, ReplicaRun
from contbatch.sim.cluster_transfer import KVLink, kv_bytes_per_token
from contbatch.sim.loop import make_request
from contbatch.sim.no_cycles import cyclic_gc_paused
from contbatch.traces import Trace, TraceRequest

# event kinds, in tie order at equal times (arrivals come from the trace, between TIMER and SCALE)
STEP_END, TRANSFER, READY, RELEASE, TIMER, ARRIVAL, SCALE, SAMPLE = range(8)
ROUTING_BLOCK = 16  # tokens per prefix key the gateway hashes
MAX_ROUTING_BLOCKS = 256

Inspect = Callable[["ClusterSim", Replica | None], None]


@dataclass(slots=True, eq=False)
class _Job:
    """A disaggregated request between its prefill and its decode."""

    spec: TraceRequest
    decode: Replica
    request: Request  # the decode side's (external KV = the prompt)
    prefill: Replica | None = None
    prefill_scheduled_ts: float | None = None
    in_transfer: bool = False
    handed: bool = False  # on its decode replica (its KV arrived)


class ClusterSim:
    def __init__(
        self,
        trace: Trace,
        fleet: FleetSpec,
        *,
        keep_timelines: bool = True,
        sample_interval: float | None = None,
        inspect: Inspect | None = None,
        decode_runs: bool = True,
    ) -> None:
        self.fleet = fleet.check()
        self.disaggregated = fleet.is_disaggregated
        _check_trace(trace, fleet)
        self.trace = trace
        self.start_ts = self.end_ts = trace.requests[0].arrival_ts if trace.requests else 0.0
        self.inspect = inspect
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.replicas: list[Replica] = []
        self.pricers: dict[str, PoolPricer] = {}
        self._pool_pricers: dict[str, PoolPricer] = {}
        self.groups = self._groups()
        self.entry = self.groups["decode" if self.disaggregated else "mixed"]  # where requests enter
        scrapes = any(g.router.needs_scrape for g in self.groups.values()) and fleet.signal_delay > 0
        delays = [p.autoscale.scrape_delay for p in fleet.pools if p.autoscale is not None]
        self.max_delay = max([fleet.signal_delay if scrapes else 0.0, *delays])
        self.keep_history = self.max_delay > 0
        self.scalers = {p.name: Autoscaler(p.autoscale) for p in fleet.pools if p.autoscale is not None}
        self.admission = None if fleet.admission.is_open else AdmissionStage(fleet.admission, self.start_ts)
        self._release_at: float | None = None
        self.release_due = False  # a request ended or a replica came up while requests wait at the gateway
        self.report = Reporter(self, sample_interval)
        self._setup_disagg()
        # decode runs hide which chunk sampled what: not with a router that counts streamed tokens
        self.use_runs = decode_runs and not any(g.router.needs_tokens for g in self.groups.values())
        self._prices: dict[str, DecodePrices] = {}
        self.needs_keys = any(g.router.needs_prefix for g in self.groups.values()) or self.decode_index is not None
        self._group_ids: dict[str, int] = {}
        self.timelines: dict[str, Timeline] | None = {} if keep_timelines else None
        self.streaming = None if keep_timelines else StreamingSummary()
        self.num_arrived = self.num_done = 0
        self.num_gateway_rejected = 0
        self.jobs: dict[str, _Job] = {}
        self.num_disaggregated = self.num_decode_only = 0
        for pool in fleet.pools:
            for _ in range(pool.num_replicas):
                self._ready(self._new_replica(pool, self.start_ts), self.start_ts)
        for pool in fleet.pools:
            if pool.autoscale is not None:
                self._push(self.start_ts + pool.autoscale.interval, SCALE, pool)

    # -- setup ---------------------------------------------------------------------------------
    def _groups(self) -> dict[str, Group]:
        fleet = self.fleet
        pricer = work_pricer(self.pricers)
        roles = ("prefill", "decode") if self.disaggregated else ("mixed",)
        groups = {}
        for role in roles:
            spec = fleet.prefill_router if role == "prefill" else fleet.router
            groups[role] = Group(role, make_router(spec, pricer=pricer), fleet.signal_delay)
        return groups

    def _setup_disagg(self) -> None:
        disagg = self.fleet.disagg
        self.link: KVLink | None = None
        self.decode_index: PrefixIndex | None = None
        if disagg is None:
            return
        prefill = self.fleet.pools_of("prefill")[0]
        self.link = KVLink(disagg.link, kv_bytes_per_token(disagg.link, prefill))
        caching = any(_hash_block_size(p) is not None for p in self.fleet.pools_of("decode"))
        if disagg.threshold > 0 and caching:
            self.decode_index = PrefixIndex()

    def _new_replica(self, pool: PoolSpec, now: float) -> Replica:
        count = sum(1 for r in self.replicas if r.pool is pool)
        replica = Replica(f"{pool.name}-{count}", len(self.replicas), pool, now, keep_history=self.keep_history)
        self.replicas.append(replica)
        pricer = self._pool_pricers.get(pool.name)
        if pricer is None:
            pricer = self._pool_pricers[pool.name] = PoolPricer(pool.cost, pool.config)
        self.pricers[replica.replica_id] = pricer
        self.groups[pool.role].add(replica)
        self.report.pool_changed(pool, now)
        return replica

    def _ready(self, replica: Replica, now: float) -> None:
        replica.state = ReplicaState.READY
        replica.ready_ts = now
        self.groups[replica.pool.role].open(replica)
        if replica.history is not None:
            replica.note(now)
        self.report.pool_changed(replica.pool, now)
        if self.admission is not None and self.admission.num_queued:
            self.release_due = True  # new room

    # -- the event loop ------------------------------------------------------------------------
    def _push(self, ts: float, kind: int, payload: object) -> int:
        self.seq += 1
        heapq.heappush(self.heap, (ts, kind, self.seq, payload))
        return self.seq

    @property
    def active(self) -> bool:
        """Requests remain to arrive or to finish."""
        return self.num_done < len(self.trace.requests)

    def run(self) -> ClusterResult:
        """Replay the trace to its end (with the cyclic garbage collector paused: `contbatch.sim.no_cycles`)."""
        with cyclic_gc_paused():
            return self._run()

    def _run(self) -> ClusterResult:
        specs, heap = self.trace.requests, self.heap
        heappop = heapq.heappop
        k, n = 0, len(specs)
        inspect = self.inspect
        arrival = specs[0].arrival_ts if n else math.inf  # the next arrival's
        while True:
            if heap and ((top := heap[0])[0] < arrival or (top[0] == arrival and top[1] < ARRIVAL)):
                now, kind, seq, payload = heappop(heap)
                if kind == STEP_END:
                    if seq == payload.event_seq:  # type: ignore[attr-defined]  # (else a cut run moved it)
                        if payload.run is not None:  # type: ignore[attr-defined]
                            self._run_step_end(payload, now)  # type: ignore[arg-type]
                        else:
                            self._step_end(payload, now)  # type: ignore[arg-type]
                else:
                    self._other_event(kind, payload, now)
            elif k < n:
                now = arrival
                self._arrive(specs[k], now)
                k += 1
                arrival = specs[k].arrival_ts if k < n else math.inf
            else:
                break
            if self.release_due:  # (never from inside a replica's step handling)
                self.release_due = False
                self._release(now)
            if inspect is not None:
                inspect(self, None)
        return self._finish()

    def _finish(self) -> ClusterResult:
        if any(r.live or r.busy for r in self.replicas) or self.jobs:
            raise RuntimeError("the fleet stopped with work pending (a scheduler that scheduled nothing)")
        for replica in self.replicas:
            if replica.run is not None:  # dormant: hand the scheduler back
                self._close_run(replica)
        return self.report.result()

    def _other_event(self, kind: int, payload: object, ts: float) -> None:
        if kind == TRANSFER:
            self._transferred(payload, ts)  # type: ignore[arg-type]
        elif kind == READY:
            replica: Replica = payload  # type: ignore[assignment]
            if replica.state is ReplicaState.PROVISIONING:
                self._ready(replica, ts)
        elif kind == RELEASE:
            self._release_at = None
            self._release(ts)
        elif kind == TIMER:
            self._wake(payload, ts)  # type: ignore[arg-type]
        elif kind == SCALE:
            self._scale(payload, ts)  # type: ignore[arg-type]
        elif kind == SAMPLE:
            self.report.sample(ts)

    # -- arrivals and the gateway --------------------------------------------------------------
    def _arrive(self, spec: TraceRequest, now: float) -> None:
        self.num_arrived += 1
        admission = self.admission
        if admission is None:
            self._dispatch(spec, now)
        elif admission.offer(spec, now):
            self._release(now)
        else:
            self.num_gateway_rejected += 1
            self._reject(spec, now, "the gateway's admission queue is full")

    def _release(self, now: float) -> None:
        admission = self.admission
        assert admission is not None
        while admission.num_queued and self._has_room():
            spec = admission.release_one(now)
            if spec is None:
                break
            self._dispatch(spec, now)
        when = admission.next_ready_ts(now)  # (a request waiting for room waits for a request to end)
        if when is not None and when > now and (self._release_at is None or when < self._release_at):
            self._release_at = when
            self._push(when, RELEASE, None)

    def _has_room(self) -> bool:
        """Some routable replica of the entry group holds fewer than `max_in_flight` requests."""
        limit = self.fleet.admission.max_in_flight
        return limit is None or any(v.num_in_flight < limit for v in self.entry.views)

    def _reject(self, spec: TraceRequest, now: float, reason: str) -> None:
        timeline = Timeline(spec.request_id, spec.arrival_ts, spec.num_prompt_tokens, tenant=spec.tenant,
                            priority=spec.priority, deadline_ts=spec.deadline_ts)  # fmt: skip
        timeline.record_finished(now, FinishReason.REJECTED)
        self._done(timeline, now)

    def route_request(self, spec: TraceRequest) -> RouteRequest:
        keys = self.prefix_keys(spec) if self.needs_keys else ()
        return RouteRequest(spec.request_id, spec.num_prompt_tokens, spec.output_limit, keys, spec.tenant)

    def prefix_keys(self, spec: TraceRequest) -> tuple[int, ...]:
        """Stable chained keys of the prompt's full blocks: a prefix group's shared blocks key
        alike across the group, the rest are the request's own (as `group_block_hashes`)."""
        count = min(spec.num_prompt_tokens // ROUTING_BLOCK, MAX_ROUTING_BLOCKS)
        shared = spec.prefix_tokens // ROUTING_BLOCK if spec.prefix_group is not None else 0
        group = self._group_ids.get(spec.prefix_group) if spec.prefix_group is not None else None
        if group is None and spec.prefix_group is not None:
            group = self._group_ids[spec.prefix_group] = text_hash("group:" + spec.prefix_group)
        own = text_hash("request:" + spec.request_id)
        return chain(mix64((group if i < shared else own) + i) for i in range(count))  # type: ignore[operator]

    def _dispatch(self, spec: TraceRequest, now: float) -> None:
        route = self.route_request(spec)
        limit = self.fleet.admission.max_in_flight
        if not self.disaggregated:
            self._place(self.entry.route(route, now, limit), spec, now)
            return
        decode = self.entry.route(route, now, limit)
        disagg = self.fleet.disagg
        assert disagg is not None
        cached = 0
        if self.decode_index is not None:
            cached = self.decode_index.match(decode.replica_id, route.prefix_keys) * ROUTING_BLOCK
            self.decode_index.record(decode.replica_id, route.prefix_keys)
        if spec.num_prompt_tokens - cached < disagg.threshold:
            self.num_decode_only += 1
            self._place(decode, spec, now)
        else:
            self._disaggregate(spec, route, decode, now)

    def _place(self, replica: Replica, spec: TraceRequest, now: float) -> None:
        request = make_request(spec, _hash_block_size(replica.pool))
        self._hand(replica, request, _stop_after(spec), now)

    def _hand(self, replica: Replica, request: Request, stop_after: int | None, now: float) -> None:
        """Give `request` to `replica` at `now`; a rejection ends it here."""
        if replica.add(request, now, stop_after).queued:
            run = replica.run
            if run is None:
                if replica.flight is None:
                    self._start(replica, now)
            elif not run.planned:  # a dormant run wakes up: the request may start in it
                self._run_next(replica, now)
            else:  # it joins at the next step boundary: the run's plan stops there
                end = run.cut(now, replica.core.totals)
                if end is not None:
                    replica.event_seq = self._push(end, STEP_END, replica)
        else:
            self._ended(replica, request, now)

    # -- disaggregation ------------------------------------------------------------------------
    def _disaggregate(self, spec: TraceRequest, route: RouteRequest, decode: Replica, now: float) -> None:
        block_size = _hash_block_size(decode.pool)
        moved = make_request(spec, block_size)
        moved.num_external_tokens = spec.num_prompt_tokens
        kind, reason = decode.scheduler.rejection(moved)
        if reason:  # it could never fit there: rejected before its prefill runs, with the reason
            decode.scheduler.stats.reject(kind)
            self.groups["decode"].tracker.finished(spec.request_id)
            moved.finish(FinishReason.REJECTED, now, reason)
            self._done(moved.timeline, now)
            return
        prefill = self.groups["prefill"].route(route, now)
        self.jobs[spec.request_id] = _Job(spec, decode, moved, prefill)
        decode.incoming += 1
        self.num_disaggregated += 1
        head = Request(spec.request_id, spec.arrival_ts, spec.num_prompt_tokens, 1, priority=spec.priority,
                       tenant=spec.tenant, deadline_ts=spec.deadline_ts,
                       block_hashes=make_request(spec, _hash_block_size(prefill.pool)).block_hashes)  # fmt: skip
        self._hand(prefill, head, None, now)

    def _prefilled(self, prefill: Replica, request: Request, now: float) -> None:
        job = self.jobs[request.request_id]
        if request.finish_reason is not FinishReason.LENGTH:  # it ended on the prefill side
            del self.jobs[request.request_id]
            job.decode.incoming -= 1
            self.groups["decode"].tracker.finished(request.request_id)
            self._done(request.timeline, now)
            self._maybe_stop(job.decode, now)
            return
        job.prefill_scheduled_ts = request.timeline.scheduled_ts[0]
        job.in_transfer = True
        assert self.link is not None
        arrival = self.link.transfer(prefill.replica_id, job.decode.replica_id, request.num_prompt_tokens, now)
        self._push(arrival, TRANSFER, job)

    def _transferred(self, job: _Job, now: float) -> None:
        job.in_transfer = False
        job.handed = True
        job.decode.incoming -= 1
        self._hand(job.decode, job.request, _stop_after(job.spec), now)
        self._maybe_stop(job.decode, now)

    # -- replicas stepping ---------------------------------------------------------------------
    def _start(self, replica: Replica, now: float) -> None:
        flight = replica.start(now)
        if flight is not None:
            replica.event_seq = self._push(flight.end_ts, STEP_END, replica)
        if len(replica.live) != replica.scheduler.num_unfinished:  # schedule() ended some (timeouts)
            for request in replica.collect([]):
                self._ended(replica, request, now)
        if flight is None and replica.live:
            timer = replica.core.next_timer()
            if timer is None or timer <= now:
                raise RuntimeError(f"replica {replica.replica_id} scheduled nothing at {now} with work pending")
            self._push(timer, TIMER, replica)

    def _step_end(self, replica: Replica, now: float) -> None:
        if replica.run is not None:
            self._run_step_end(replica, now)
            return
        flight = replica.flight
        ended = replica.end()
        group = self.groups[replica.pool.role]
        if group.router.needs_tokens and flight is not None and flight.result is not None:
            tracker, sampled = group.tracker, flight.result.sampled_token_ids
            for chunk in flight.out.chunks:
                if chunk.samples and chunk.request_id in sampled:
                    if chunk.is_prefill:
                        tracker.first_token(chunk.request_id)
                    else:
                        tracker.tokens(chunk.request_id, len(sampled[chunk.request_id]))
        for request in ended:
            self._ended(replica, request, now)
        if self.inspect is not None:
            self.inspect(self, replica)
        self._next_step(replica, now)

    def _next_step(self, replica: Replica, now: float) -> None:
        """Between two steps: a decode run when the coming steps are foregone, else a stepped one."""
        if not replica.scheduler.has_unfinished():
            if replica.history is not None:
                replica.note(now)  # idle from now on
            self._maybe_stop(replica, now)
        elif not self._open_run(replica, now):
            self._start(replica, now)

    # -- decode runs (contbatch.sim.cluster_runs) -----------------------------------------------
    def _open_run(self, replica: Replica, now: float) -> bool:
        scheduler = replica.scheduler
        if not self.use_runs or not isinstance(scheduler, ContinuousScheduler):
            return False
        prices = self._prices.get(replica.pool.name)
        if prices is None:
            prices = self._prices[replica.pool.name] = DecodePrices(replica.pool.cost)
        # with scrape history, one step at a time: every step's KV usage is noted as it starts
        steps = 1 if replica.history is not None else SEGMENT_STEPS
        run = ReplicaRun.open(scheduler, replica.executor, replica.clock, prices, steps)
        if run is None:
            return False
        end = run.plan(now)
        if end is None:
            run.close()
            return False
        replica.run = run
        replica.event_seq = self._push(end, STEP_END, replica)
        if replica.history is not None:
            replica.note(now)
        return True

    def _run_step_end(self, replica: Replica, now: float) -> None:
        run = replica.run
        assert run is not None
        run.commit(replica.core.totals)
        for request in replica.collect([]):
            self._ended(replica, request, now)
        self._run_next(replica, now)

    def _run_next(self, replica: Replica, now: float) -> None:
        """The run's next steps from `now`; dormant when it is empty; else closed, and stepping."""
        run = replica.run
        assert run is not None
        end = run.plan(now)
        if end is not None:
            replica.event_seq = self._push(end, STEP_END, replica)
        elif run.is_empty:
            self._maybe_stop(replica, now)
        else:
            self._close_run(replica)
            self._next_step(replica, now)
        if replica.history is not None:
            replica.note(now)

    def _close_run(self, replica: Replica) -> None:
        assert replica.run is not None
        replica.run.close()
        replica.run = None
        if self.inspect is not None:
            self.inspect(self, replica)

    def _wake(self, replica: Replica, now: float) -> None:
        if not replica.busy and replica.scheduler.has_unfinished():
            self._start(replica, now)

    def _ended(self, replica: Replica, request: Request, now: float) -> None:
        role = replica.pool.role
        self.groups[role].tracker.finished(request.request_id)
        if role == "prefill":
            self._prefilled(replica, request, now)
            return
        if self.admission is not None and self.admission.num_queued:
            self.release_due = True  # room for one waiting at the gateway, once this event is handled
        job = self.jobs.pop(request.request_id, None) if role == "decode" else None
        if job is not None and job.prefill_scheduled_ts is not None:
            stamps = request.timeline.scheduled_ts
            if stamps:
                stamps[0] = job.prefill_scheduled_ts  # the fleet's first admission was the prefill's
            else:
                stamps.append(job.prefill_scheduled_ts)
        self._done(request.timeline, now)

    def _done(self, timeline: Timeline, now: float) -> None:
        self.num_done += 1
        self.end_ts = max(self.end_ts, now)
        if self.timelines is not None:
            if timeline.request_id in self.timelines:
                raise RuntimeError(f"request {timeline.request_id!r} ended twice")
            self.timelines[timeline.request_id] = timeline
        else:
            assert self.streaming is not None
            self.streaming.add(timeline)

    # -- autoscaling ---------------------------------------------------------------------------
    def _scale(self, pool: PoolSpec, now: float) -> None:
        scaler = self.scalers[pool.name]
        cfg = scaler.config
        mine = [r for r in self.replicas if r.pool is pool]
        ready = [r for r in mine if r.state is ReplicaState.READY]
        provisioning = [r for r in mine if r.state is ReplicaState.PROVISIONING]
        values = [v for v in (_metric(r, cfg.metric, now - cfg.scrape_delay, now) for r in ready) if v is not None]
        backlog = self.admission.num_queued if self.admission is not None and cfg.metric != "kv_usage" else 0
        decision = scaler.decide(now, values, len(ready), len(provisioning), float(backlog))
        for _ in range(decision.change):
            replica = self._new_replica(pool, now)
            self._push(now + cfg.provisioning_delay, READY, replica)
        removing = -decision.change
        for replica in reversed(provisioning[:removing] if removing > 0 else []):
            self._stop(replica, now)
        removing -= min(removing, len(provisioning))
        victims = sorted(ready, key=lambda r: (len(r.live) + r.incoming, -r.index))[: max(0, removing)]
        for replica in victims:
            self._drain(replica, now)
        if decision.change:
            self.report.scaled(pool, now, decision)
        for replica in self.replicas:
            if replica.pool is pool:
                replica.trim(now - self.max_delay)
        if self.active:
            self._push(now + cfg.interval, SCALE, pool)

    def _drain(self, replica: Replica, now: float) -> None:
        self.groups[replica.pool.role].close(replica)
        replica.state = ReplicaState.DRAINING
        self.report.pool_changed(replica.pool, now)
        self._maybe_stop(replica, now)

    def _maybe_stop(self, replica: Replica, now: float) -> None:
        if replica.state is ReplicaState.DRAINING and replica.is_idle:
            self._stop(replica, now)

    def _stop(self, replica: Replica, now: float) -> None:
        if replica.run is not None:
            self._close_run(replica)
        was_ready = replica.state is not ReplicaState.PROVISIONING
        replica.state = ReplicaState.STOPPED
        replica.stop_ts = now
        if was_ready:
            self.groups[replica.pool.role].forget(replica)
        self.report.pool_changed(replica.pool, now)

    # -- invariants ----------------------------------------------------------------------------
    def check(self) -> None:
        """The fleet-level accounting (AssertionError naming what is wrong)."""
        where: dict[str, str] = {}
        for replica in self.replicas:
            assert len(replica.live) == replica.scheduler.num_unfinished, f"{replica}: live != scheduler"
            if replica.state is ReplicaState.STOPPED:
                assert not replica.live and not replica.busy, f"{replica} stopped with work"
            for rid in replica.live:
                assert replica.scheduler.contains(rid), f"{rid} live on {replica} but not in its scheduler"
                assert rid not in where, f"{rid} on {where[rid]} and {replica.replica_id}"
                where[rid] = replica.replica_id
        in_transfer = [job for job in self.jobs.values() if job.in_transfer]
        for job in in_transfer:
            rid = job.spec.request_id
            assert rid not in where, f"{rid} in transfer and on {where.get(rid)}"
        queued = self.admission.num_queued if self.admission is not None else 0
        unfinished = len(where) + len(in_transfer) + queued
        assert self.num_arrived == self.num_done + unfinished, (
            f"arrived {self.num_arrived} != done {self.num_done} + unfinished {unfinished}"
        )
        for group in self.groups.values():
            group.tracker.check()
        incoming = {r.replica_id: 0 for r in self.replicas}
        for job in self.jobs.values():
            incoming[job.decode.replica_id] += 0 if job.handed else 1
        for replica in self.replicas:
            assert replica.incoming == incoming[replica.replica_id], f"{replica}: incoming transfers miscounted"


def _metric(replica: Replica, metric: str, ts: float, now: float) -> float | None:
    scrape = replica.scrape_at(ts, now)
    if scrape is None:
        return None
    if metric == "kv_usage":
        return scrape.kv_usage
    if metric == "queue_length":
        return float(scrape.num_waiting)
    return float(scrape.num_waiting + scrape.num_running)


def _hash_block_size(pool: PoolSpec) -> int | None:
    kv = pool.config.kv
    return kv.block_size if kv is not None and kv.enable_prefix_caching else None


def _stop_after(spec: TraceRequest) -> int | None:
    return spec.num_output_tokens if spec.num_output_tokens < spec.output_limit else None


def _check_trace(trace: Trace, fleet: FleetSpec) -> None:
    if trace.time_unit != fleet.time_unit:
        raise ValueError(f"the trace is timed in {trace.time_unit} but the fleet's cost models in {fleet.time_unit}")
    if any(r.cancel_ts is not None or r.read_rate is not None for r in trace.requests):
        raise ValueError("the cluster simulator does not model client cancellations or read rates")


def simulate_cluster(
    trace: Trace,
    fleet: FleetSpec,
    *,
    keep_timelines: bool = True,
    sample_interval: float | None = None,
    inspect: Inspect | None = None,
    decode_runs: bool = True,
) -> ClusterResult:
    """Replay `trace` on `fleet` (see the module docstring). `keep_timelines=False` folds each
    request into a streaming summary as it ends (for millions of requests); `sample_interval`
    records each replica's load and KV usage that often (for plots); `inspect(sim, replica)`
    runs after every event (replica None) and after each replica's step results (that replica).
    `decode_runs` takes foregone steps as decode runs (`contbatch.sim.cluster_runs`; the same
    results as stepping, faster)."""
    sim = ClusterSim(
        trace, fleet, keep_timelines=keep_timelines, sample_interval=sample_interval, inspect=inspect,
        decode_runs=decode_runs,
    )  # fmt: skip
    return sim.run()
