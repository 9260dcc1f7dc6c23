"""The gateway's admission stage: a bounded queue in front of a global token bucket and
per-tenant token buckets. (The fleet's per-replica in-flight limit is the simulator's: it asks
for one request at a time, `release_one`, while some replica has room.)

A bucket of rate `r` and size `burst` starts full and refills continuously; a request takes one
token from its tenant's bucket (when its tenant has a rate) and one from the global bucket (when
there is a global rate). Requests wait in arrival order per tenant; the tenants' heads are
served oldest first, and a tenant whose bucket is empty does not hold up the others. A request
arriving to a full queue (`max_queue` waiting) is rejected. Without any rate the stage admits
everyone at once.

Invariants: a request leaves the queue exactly once (admitted or never queued); the queue never
holds more than `max_queue`; a bucket never holds more than `burst` nor less than 0 tokens.
"""

from __future__ import annotations

import math
from collections import deque

from contbatch.sim.cluster_config import AdmissionConfig
from contbatch.traces import TraceRequest


class _Bucket:
    __slots__ = ("burst", "rate", "tokens", "ts")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.ts = rate, burst, burst, now

    def refill(self, now: float) -> None:
        if now > self.ts:
            self.tokens = min(self.burst, self.tokens + (now - self.ts) * self.rate)
            self.ts = now

    def ready_at(self, now: float) -> float:
        """When it holds a whole token (now if it does)."""
        self.refill(now)
        return now if self.tokens >= 1.0 - 1e-12 else now + (1.0 - self.tokens) / self.rate


class AdmissionStage:
    def __init__(self, config: AdmissionConfig, start: float) -> None:
        self.config = config
        self._global = _Bucket(config.rate, config.burst, start) if config.rate is not None else None
        self._tenant_rates = dict(config.tenant_rates)
        self._tenants: dict[str | None, _Bucket] = {}
        self._queues: dict[str | None, deque[TraceRequest]] = {}
        self.num_queued = 0
        self.num_rejected = 0
        self.max_queued = 0

    def _bucket(self, tenant: str | None, now: float) -> _Bucket | None:
        rate = self._tenant_rates.get(tenant) if tenant is not None else None
        if rate is None:
            return None
        bucket = self._tenants.get(tenant)
        if bucket is None:
            bucket = self._tenants[tenant] = _Bucket(rate, self.config.burst, now)
        return bucket

    def offer(self, spec: TraceRequest, now: float) -> bool:
        """Queue an arriving request; False when the queue is full (the request is rejected)."""
        bound = self.config.max_queue
        if bound is not None and self.num_queued >= bound:
            self.num_rejected += 1
            return False
        self._queues.setdefault(spec.tenant, deque()).append(spec)
        self.num_queued += 1
        self.max_queued = max(self.max_queued, self.num_queued)
        return True

    def release(self, now: float) -> list[TraceRequest]:
        """The queued requests that may go now, in the order they go."""
        released: list[TraceRequest] = []
        while (spec := self.release_one(now)) is not None:
            released.append(spec)
        return released

    def release_one(self, now: float) -> TraceRequest | None:
        """The next queued request that may go now (its tokens taken), or None."""
        if not self.num_queued:
            return None
        found, head = self._next_head(now)
        if not found:
            return None
        spec = self._queues[head].popleft()
        for bucket in (self._bucket(head, now), self._global):
            if bucket is not None:
                bucket.tokens -= 1.0
        self.num_queued -= 1
        return spec

    def _next_head(self, now: float) -> tuple[bool, str | None]:
        """(True, the tenant whose head goes next: oldest first among those with tokens), or
        (False, None) when no queued request may go now."""
        if self._global is not None and self._global.ready_at(now) > now:
            return False, None
        best: tuple[float, str] | None = None
        chosen: str | None = None
        for tenant, queue in self._queues.items():
            if not queue:
                continue
            bucket = self._bucket(tenant, now)
            if bucket is not None and bucket.ready_at(now) > now:
                continue
            key = (queue[0].arrival_ts, queue[0].request_id)
            if best is None or key < best:
                best, chosen = key, tenant
        return best is not None, chosen

    def next_ready_ts(self, now: float) -> float | None:
        """When the next queued request may go (None with an empty queue)."""
        if not self.num_queued:
            return None
        when = math.inf
        for tenant, queue in self._queues.items():
            if queue:
                bucket = self._bucket(tenant, now)
                when = min(when, bucket.ready_at(now) if bucket is not None else now)
        if self._global is not None:
            when = max(when, self._global.ready_at(now))
        return when
