"""The gateway on 127.0.0.1 (a free port), run by uvicorn in a thread of the test process, in
front of backends given by URL (`server.harness` starts `contbatch serve` apps the same way)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from contbatch.bench.servers import free_port
from contbatch.gateway.app import create_gateway_app
from contbatch.gateway.config import GatewayConfig, backends_of
from contbatch.gateway.proxy import Gateway
from contbatch.server.connections import limited_protocol

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_values(text: str) -> Metrics:
    """(sample name, sorted labels without model_name) -> value, of a Prometheus text."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def serve_in_thread(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
                            http=limited_protocol(None, None))  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", server, thread


@dataclass
class RunningGateway:
    base_url: str
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.app.state.gateway
        return gateway

    def get(self, path: str, **kw: Any) -> httpx.Response:
        with httpx.Client(timeout=10) as http:
            return http.get(self.base_url + path, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        with httpx.Client(timeout=30) as http:
            return http.post(self.base_url + path, **kw)

    def metrics(self) -> Metrics:
        return metric_values(self.get("/metrics").text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_gateway(urls: list[str], **options: Any) -> RunningGateway:
    """A gateway in front of `urls` with `GatewayConfig` `options`."""
    app = create_gateway_app(GatewayConfig(backends=backends_of(urls), **options))
    base_url, server, thread = serve_in_thread(app)
    return RunningGateway(base_url, app, server, thread)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.02)


@pytest.fixture
def make_gateway() -> Iterator[Callable[..., RunningGateway]]:
    """Start gateways on demand (`start_gateway`'s arguments); every one is stopped afterwards."""
    started: list[RunningGateway] = []

    def make(urls: list[str], **options: Any) -> RunningGateway:
        gateway = start_gateway(urls, **options)
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.stop()


@dataclass
class RunningApp:
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
def serve_app() -> Iterator[Callable[[Any], RunningApp]]:
    """Serve any ASGI app (a `fakes.FakeBackend`'s) on a free port; stopped afterwards."""
    started: list[RunningApp] = []

    def serve(app: Any) -> RunningApp:
        running = RunningApp(*serve_in_thread(app))
        started.append(running)
        return running

    yield serve
    for running in started:
        running.stop()


def dead_url() -> str:
    """A URL where nothing listens (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"
