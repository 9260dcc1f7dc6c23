"""Autoscaling a pool: a target metric per replica, acted on every control interval.

At each tick (every `interval`) the autoscaler reads the pool's ready replicas' metric from
scrapes `scrape_delay` old: `kv_usage` (fraction of KV blocks in use), `queue_length` (waiting
requests) or `in_flight` (waiting + running requests); for the last two, requests waiting at the
gateway (its flow control) count too, shared over the ready replicas. Like Kubernetes' HPA it
wants ``ceil(ready * mean / target)`` replicas, keeps the count while the mean is within
`tolerance` of the target, and clamps to [`min_replicas`, `max_replicas`]; a scale-down goes only
to the most replicas wanted over the last `scale_down_cooldown` (HPA's stabilization window, so
one quiet tick does not flap the fleet). It adds replicas at most once per `scale_up_cooldown`
and removes them at most once per `scale_down_cooldown` (both since the last change). A new
replica is billed from its request and serves after `provisioning_delay`. Removing one first
cancels replicas still provisioning, then drains ready ones (the fewest in flight, newest first
on ties): a draining replica takes no new requests, finishes those it has, then stops; none is
ever dropped.

`decide` is a function of its arguments and of its own past ticks (the last change's time and
the stabilization window), so a tick's decision is reproducible and testable alone.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

METRICS = ("kv_usage", "queue_length", "in_flight")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    metric: str = "in_flight"
    target: float = 16.0  # per ready replica, in the metric's unit
    interval: float = 15.0  # control interval (clock units)
    scrape_delay: float = 0.0  # the metric is read as of now - scrape_delay
    provisioning_delay: float = 60.0  # from the decision to a replica that serves
    scale_up_cooldown: float = 0.0
    scale_down_cooldown: float = 120.0
    min_replicas: int = 1
    max_replicas: int = 8
    tolerance: float = 0.1

    def check(self, owner: str) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"{owner}: autoscale metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        numbers = (self.interval, self.target)
        delays = (self.scrape_delay, self.provisioning_delay, self.scale_up_cooldown, self.scale_down_cooldown)
        if any(not v > 0 for v in numbers) or any(not v >= 0 for v in (*delays, self.tolerance)):
            raise ValueError(f"{owner}: autoscale interval and target must be > 0, delays and tolerance >= 0")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"{owner}: autoscale needs 1 <= min_replicas <= max_replicas")


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int  # replicas wanted (ready + provisioning after the change)
    change: int  # > 0: add; < 0: remove; 0: nothing
    observed: float | None  # the mean metric over ready replicas (None: no ready replica)


class Autoscaler:
    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self.last_change_ts: float | None = None
        self.decisions: list[tuple[float, Decision]] = []
        self._wanted: deque[tuple[float, int]] = deque()  # (tick, replicas wanted) in the stabilization window

    def desired(
        self, values: list[float], num_ready: int, num_current: int, backlog: float = 0.0
    ) -> tuple[int, float | None]:
        cfg = self.config
        if not values:
            return max(num_current, cfg.min_replicas), None
        mean = (sum(values) + backlog) / len(values)
        ratio = mean / cfg.target
        if abs(ratio - 1.0) <= cfg.tolerance:
            want = num_current
        else:
            want = max(1, math.ceil(num_ready * ratio - 1e-9))
            # replicas still provisioning count towards scaling up (they will serve soon)
            want = max(want, num_current) if want > num_ready else want
        return min(cfg.max_replicas, max(cfg.min_replicas, want)), mean

    def decide(
        self, now: float, values: list[float], num_ready: int, num_provisioning: int, backlog: float = 0.0
    ) -> Decision:
        """The change to make at `now`, given the metric of each ready replica (`values`) and
        what waits at the gateway (`backlog`, in the metric's unit, shared over them)."""
        cfg = self.config
        current = num_ready + num_provisioning
        want, mean = self.desired(values, num_ready, current, backlog)
        wanted = self._wanted
        wanted.append((now, want))
        while wanted[0][0] < now - cfg.scale_down_cooldown:
            wanted.popleft()
        if want < current:
            want = min(current, max(w for _, w in wanted))  # stabilized: the most wanted in the window
        since = math.inf if self.last_change_ts is None else now - self.last_change_ts
        change = want - current
        if (change > 0 and since < cfg.scale_up_cooldown) or (change < 0 and since < cfg.scale_down_cooldown):
            change = 0
        decision = Decision(want, change, mean)
        if change:
            self.last_change_ts = now
        self.decisions.append((now, decision))
        return decision
