"""`contbatch serve --backend sim` as its own process on 127.0.0.1: the black box of these tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def sim_server(cost: str, *extra: str) -> Iterator[str]:
    """Serve the sim backend priced by `cost` in a child process; yields its URL once /health answers."""
    port = free_port()
    argv = [sys.executable, "-m", "contbatch.cli.main", "serve", "--backend", "sim", "--cost", cost,
            "--model", "sim", "--port", str(port), "--log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "the server exited"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the sim server did not come up"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def dead_url() -> str:
    """A URL where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"
