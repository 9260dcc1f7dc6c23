from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server.harness import RunningServer, start_server


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
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
    return make_server()
