"""`contbatch serve --backend sim` as its own process on 127.0.0.1: the black box of these tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from contbatch.bench.servers import contbatch_argv, free_port, running_server


@contextmanager
def sim_server(cost: str, *extra: str) -> Iterator[str]:
    """Serve the sim backend priced by `cost` in a child process; yields its URL once /health answers."""
    port = free_port()
    argv = contbatch_argv("serve", "--backend", "sim", "--cost", cost, "--model", "sim", *extra, port=port)
    with running_server(argv, port) as server:
        yield server.url


def dead_url() -> str:
    """A URL where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"
