"""A real server on 127.0.0.1 (a free port), run by uvicorn in a thread of the test process.

Shared by tests/server and tests/bench (`server.harness`). `start_server` builds the sim
backend from a cost spec and scheduler config overrides (over the `engine` preset), or takes a
ready backend or client (tests that inject failures)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from contbatch.core import SchedulerConfig
from contbatch.core.config import PRESETS
from contbatch.server.app import create_app
from contbatch.server.backends.sim import SimBackend
from contbatch.server.client import DriverClient
from contbatch.server.serving import ServerConfig
from contbatch.sim.cost import parse_cost

MODEL = "sim-model"
_SSL = ssl.create_default_context()  # built once: httpx builds one per client otherwise (~40 ms)


@dataclass
class RunningServer:
    base_url: str
    client: DriverClient
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def scheduler(self) -> Any:
        return self.client.driver.scheduler

    def get(self, path: str, **kw: Any) -> httpx.Response:
        with httpx.Client(verify=_SSL, timeout=10) as http:
            return http.get(self.base_url + path, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        with httpx.Client(verify=_SSL, timeout=30) as http:
            return http.post(self.base_url + path, **kw)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        with httpx.Client(verify=_SSL, timeout=30) as http:
            return http.request(method, self.base_url + path, **kw)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the driver has no live request and the scheduler nothing unfinished."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.client.snapshot()
            if snap.num_live == 0 and snap.num_running == 0 and snap.num_waiting == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"server not idle after {timeout}s: {self.client.snapshot()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def sim_backend(cost: str = "affine:base_ms=5", overrides: dict[str, Any] | None = None) -> SimBackend:
    config = SchedulerConfig.from_dict(overrides or {}, base=PRESETS["engine"])
    return SimBackend(parse_cost(cost), config, model_name=MODEL)


def start_server(
    cost: str = "affine:base_ms=5",
    overrides: dict[str, Any] | None = None,
    server_config: ServerConfig | None = None,
    backend: Any = None,
    client: DriverClient | None = None,
) -> RunningServer:
    """A server over `client`, or over a `DriverClient` of `backend` (default: a sim backend of
    `cost` and `overrides`)."""
    if client is None:
        client = DriverClient(backend if backend is not None else sim_backend(cost, overrides))
    # the tests' clients name their tenants with X-Tenant (the server's default ignores it)
    app = create_app(client, server_config or ServerConfig(shutdown_grace_s=1.0, trust_tenant_header=True))
    return start_app(app)


def start_app(app: Any, **uvicorn_options: Any) -> RunningServer:
    """Serve a ready app (`create_app`'s, or `contbatch serve`'s `build_app`) on a free port, with
    `uvicorn_options` (`contbatch.cli.serve_cmd.uvicorn_options` gives `contbatch serve`'s)."""
    client = app.state.client
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options = {"log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": 2, **uvicorn_options}
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return RunningServer(f"http://127.0.0.1:{port}", client, server, thread)


@contextmanager
def running(*args: Any, **kwargs: Any) -> Iterator[RunningServer]:
    server = start_server(*args, **kwargs)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
    """Start servers on demand (`start_server`'s arguments); every one is stopped afterwards."""
    started: list[RunningServer] = []

    def make(*args: Any, **kwargs: Any) -> RunningServer:
        server = start_server(*args, **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def server(make_server: Callable[..., RunningServer]) -> RunningServer:
    """One server with the defaults."""
    return make_server()
