"""Health checks and load scrapes of the backends, in the background of the gateway's event loop.

- Health: every `health_interval_s`, ``GET /health`` on every backend at once; a check is good
  when it answers 200 within `health_timeout_s`. `unhealthy_after` failed checks in a row take a
  backend out of the rotation, `healthy_after` good ones bring it back. A connection that fails
  while proxying takes the backend out at once (`failed`); the checks bring it back. With
  `health_interval_s` 0 there are no checks and every backend stays in the rotation (a failed
  connection is then only retried elsewhere).
- Load: every `scrape_interval_s`, ``GET /metrics`` on every backend (`contbatch.gateway.scrape`);
  routers that read the load (`least_kv`, the `queue` and `kv` scorers) see the last scrape, so
  the interval is what the simulator calls `signal_delay`. A backend whose scrape fails, or that
  exports no load gauges, has no scrape: routers use the gateway's own counts.

The first round of checks and scrapes runs before the gateway serves (`start`), so a backend
that is down at start is never offered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import httpx

from contbatch.gateway.balancer import Balancer
from contbatch.gateway.config import GatewayConfig
from contbatch.gateway.scrape import parse_scrape

log = logging.getLogger(__name__)


class Monitor:
    def __init__(
        self,
        config: GatewayConfig,
        balancer: Balancer,
        http: httpx.AsyncClient,
        headers: Mapping[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.balancer = balancer
        self.http = http
        self.headers = dict(headers)
        self.clock = clock
        self.urls = {b.name: b.url for b in config.backends}
        self._good = dict.fromkeys(self.urls, 0)  # consecutive good checks
        self._bad = dict.fromkeys(self.urls, 0)  # consecutive failed checks
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def checks_health(self) -> bool:
        return self.config.health_interval_s > 0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """One round of checks and scrapes, then the periodic ones in the background."""
        first = []
        if self.checks_health:
            first.append(self.check_all())
        if self.config.scrape_interval_s > 0:
            first.append(self.scrape_all())
        await asyncio.gather(*first)
        if self.checks_health:
            self._tasks.append(asyncio.create_task(self._every(self.config.health_interval_s, self.check_all)))
        if self.config.scrape_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._every(self.config.scrape_interval_s, self.scrape_all)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except Exception:  # a round that fails must not end the monitoring
                log.exception("a round of backend checks failed")

    # -- health -----------------------------------------------------------------------------------
    async def check_all(self) -> None:
        results = await asyncio.gather(*(self._check(url) for url in self.urls.values()))
        for backend, ok in zip(self.urls, results, strict=True):
            self.note(backend, ok)

    async def _check(self, url: str) -> bool:
        try:
            response = await self.http.get(url + "/health", headers=self.headers, timeout=self.config.health_timeout_s)
        except (httpx.HTTPError, OSError):
            return False
        return response.status_code == 200

    def note(self, backend: str, ok: bool) -> None:
        """One health check's outcome."""
        if ok:
            self._good[backend] += 1
            self._bad[backend] = 0
            if self._good[backend] >= self.config.healthy_after and self.balancer.set_healthy(backend, True):
                log.warning("backend %s is back in the rotation", backend)
        else:
            self._bad[backend] += 1
            self._good[backend] = 0
            if self._bad[backend] >= self.config.unhealthy_after and self.balancer.set_healthy(backend, False):
                log.warning("backend %s failed its health check: out of the rotation", backend)

    def failed(self, backend: str) -> None:
        """A connection to `backend` failed while proxying: out of the rotation until its checks
        pass again (only when there are checks to bring it back)."""
        if not self.checks_health:
            return
        self._good[backend] = 0
        self._bad[backend] = max(self._bad[backend], self.config.unhealthy_after)
        if self.balancer.set_healthy(backend, False):
            log.warning("backend %s failed a connection: out of the rotation", backend)

    # -- load ---------------------------------------------------------------------------------------
    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(backend, url) for backend, url in self.urls.items()))

    async def _scrape(self, backend: str, url: str) -> None:
        try:
            response = await self.http.get(url + "/metrics", headers=self.headers, timeout=self.config.health_timeout_s)
            scrape = parse_scrape(response.text, self.clock()) if response.status_code == 200 else None
        except (httpx.HTTPError, OSError, UnicodeDecodeError):
            scrape = None
        self.balancer.scraped(backend, scrape)
