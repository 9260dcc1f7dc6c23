"""The gateway's own Prometheus metrics (``GET /metrics``), one registry per gateway.

- ``contbatch:gateway_requests_routed_total{backend}``: attempts sent to each backend (a retried
  request counts once per attempt);
- ``contbatch:gateway_retries_total{backend}``: attempts on that backend that failed before any
  byte reached the client and were tried again elsewhere;
- ``contbatch:gateway_upstream_errors_total{backend,stage}``: a backend's failures: ``connect``
  (no answer: refused, reset, timed out), ``status`` (it answered 502 or 503), ``body`` (its
  answer broke off);
- ``contbatch:gateway_client_disconnects_total``: clients that left before their answer ended
  (passed on to the backend as a cancellation);
- ``contbatch:gateway_http_request_errors_total{status}``: responses the gateway sent with an
  error status (its own, and the backends' it relayed);
- ``contbatch:gateway_requests_in_flight{backend}``: requests the gateway has on that backend now
  (its `LoadTracker`);
- ``contbatch:gateway_backend_healthy{backend}``: 1 in the rotation, 0 out of it;
- ``contbatch:gateway_backend_scrape_age_seconds{backend}``: age of the load scrape routers see
  (absent without one).

Every series of every configured backend is exported from the start, at 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contbatch.gateway.balancer import Balancer

PREFIX = "contbatch:gateway_"
STAGES = ("connect", "status", "body")
ERROR_STATUSES = (400, 401, 404, 405, 408, 413, 415, 429, 499, 500, 502, 503, 504)


class GatewayMetrics:
    def __init__(self, balancer: Balancer, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.routed = Counter(PREFIX + "requests_routed", "Attempts sent to each backend.", ["backend"], registry=reg)
        self.retries = Counter(
            PREFIX + "retries",
            "Attempts that failed before any byte reached the client and were tried on another backend.",
            ["backend"],
            registry=reg,
        )
        self.upstream_errors = Counter(
            PREFIX + "upstream_errors",
            "Backend failures, by stage: connect (no answer), status (502 or 503), body (the answer broke off).",
            ["backend", "stage"],
            registry=reg,
        )
        self.disconnects = Counter(
            PREFIX + "client_disconnects",
            "Clients that left before their answer ended (passed on to the backend as a cancellation).",
            registry=reg,
        )
        self.http_errors = Counter(
            PREFIX + "http_request_errors",
            "Responses sent with an error status (4xx, 5xx), by status code.",
            ["status"],
            registry=reg,
        )
        reg.register(_StateCollector(balancer, clock))
        for backend in balancer.backends:
            self.routed.labels(backend)
            self.retries.labels(backend)
            for stage in STAGES:
                self.upstream_errors.labels(backend, stage)
        for status in ERROR_STATUSES:
            self.http_errors.labels(str(status))

    def count_http_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """In flight, health and scrape age of each backend, read from the balancer at scrape time."""

    def __init__(self, balancer: Balancer, clock: Callable[[], float]) -> None:
        self._balancer = balancer
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        balancer = self._balancer
        in_flight = GaugeMetricFamily(
            PREFIX + "requests_in_flight", "Requests the gateway has on each backend now.", labels=["backend"]
        )
        healthy = GaugeMetricFamily(
            PREFIX + "backend_healthy", "1 while the backend is in the rotation, else 0.", labels=["backend"]
        )
        age = GaugeMetricFamily(
            PREFIX + "backend_scrape_age_seconds",
            "Age of the backend's last load scrape (absent without one).",
            labels=["backend"],
        )
        now = self._clock()
        for backend in balancer.backends:
            view = balancer.tracker.view(backend)
            in_flight.add_metric([backend], float(view.num_in_flight))
            healthy.add_metric([backend], 1.0 if balancer.is_healthy(backend) else 0.0)
            if view.scrape is not None:
                age.add_metric([backend], max(0.0, now - view.scrape.ts))
        yield in_flight
        yield healthy
        yield age
