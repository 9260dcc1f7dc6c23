"""Servers as child processes, for the benchmarks and tests that drive them over HTTP: the one way
to start a server on a free port of 127.0.0.1, wait until its ``/health`` answers 200, and stop it.

Invariants: `running_server` yields only a server that answered ``/health``; when its block ends
the process is gone (terminated, killed after `stop_s`); a server that exits or stays unhealthy
for `start_s` raises `ServerStartError` with the tail of its output. Output goes to a log file
(the caller's, or a temporary one removed on stop), never to a pipe that a chatty server could
fill.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time (the message ends with its output)."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def contbatch_argv(*args: str, port: int) -> list[str]:
    """``python -m contbatch.cli.main ARGS --port PORT --log-level warning`` (`serve`, `route`)."""
    return [sys.executable, "-m", "contbatch.cli.main", *args, "--port", str(port), "--log-level", "warning"]


def transformers_serve_argv(
    model: str,
    *,
    port: int,
    num_blocks: int,
    max_batch_tokens: int,
    block_size: int | None = None,
    dtype: str | None = None,
    device: str = "cpu",
) -> list[str]:
    """``transformers serve MODEL --continuous-batching`` on `device` with its paged cache given
    (`num_blocks` of `block_size` tokens: sized from memory, its set-up takes long on a CPU) and
    its token budget per step (`max_batch_tokens`)."""
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", model, "--continuous-batching",
            "--device", device, "--host", "127.0.0.1", "--port", str(port), "--cb-num-blocks", str(num_blocks),
            "--cb-max-batch-tokens", str(max_batch_tokens), "--log-level", "warning"]  # fmt: skip
    if block_size is not None:
        argv += ["--cb-block-size", str(block_size)]
    if dtype is not None:
        argv += ["--dtype", dtype]
    return argv


TRANSFORMERS_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # no download, ever


def transformers_serve_missing() -> str | None:
    """Why `transformers serve --continuous-batching` cannot run in this environment (None: it can)."""
    import importlib.util

    for module, why in (
        ("transformers", "transformers is not installed"),
        ("accelerate", "accelerate is not installed (transformers serve loads with a device_map)"),
        ("fastapi", "fastapi is not installed"),
        ("uvicorn", "uvicorn is not installed"),
        ("openai", "openai is not installed (transformers serve validates requests with its types)"),
    ):
        if importlib.util.find_spec(module) is None:
            return why
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return f"transformers {transformers.__version__} has no `serve --continuous-batching` (5.x has)"
    from transformers.utils.import_utils import is_serve_available

    return None if is_serve_available() else "transformers reports its serving extra as unavailable"


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    log: Path  # its stdout and stderr
    owns_log: bool  # a temporary log, removed by `stop`

    def output_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> None:
        """Return once ``/health`` answers 200; `ServerStartError` if the process exits first or
        `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        name = " ".join(self.process.args[:4]) if isinstance(self.process.args, list) else str(self.process.args)
        while True:
            if self.process.poll() is not None:
                raise ServerStartError(f"{name} exited with {self.process.returncode}:\n{self.output_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerStartError(f"{name} was not healthy after {timeout_s:g} s:\n{self.output_tail()}")
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate the process (kill it after `timeout_s`) and wait for it; idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.owns_log:
            self.log.unlink(missing_ok=True)


def start_server(
    argv: Sequence[str], port: int, *, env: Mapping[str, str] | None = None, log: Path | None = None,
    cwd: Path | None = None,
) -> ServerProcess:  # fmt: skip
    """Start `argv` (a server told to listen on `port`) without waiting for it; `env` is added
    to this process's environment."""
    owns_log = log is None
    if log is None:
        handle, name = tempfile.mkstemp(prefix="contbatch-server-", suffix=".log")
        os.close(handle)
        log = Path(name)
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd
        )
    return ServerProcess(process, f"http://127.0.0.1:{port}", log, owns_log)


@contextlib.contextmanager
def running_server(
    argv: Sequence[str], port: int, *, env: Mapping[str, str] | None = None, log: Path | None = None,
    cwd: Path | None = None, start_s: float = 60.0, stop_s: float = 15.0,
) -> Iterator[ServerProcess]:  # fmt: skip
    """`start_server`, wait until healthy, yield it; stopped when the block ends."""
    server = start_server(argv, port, env=env, log=log, cwd=cwd)
    try:
        server.wait_healthy(start_s)
        yield server
    finally:
        server.stop(stop_s)
