"""`contbatch.bench.servers`: a server that exits or never answers /health is a clear error with
its output, and its process is gone afterwards; a healthy one is yielded and then stopped."""

from __future__ import annotations

import sys

import pytest

from contbatch.bench.servers import ServerStartError, contbatch_argv, free_port, running_server, start_server


def test_a_server_that_exits_raises_with_its_output() -> None:
    argv = [sys.executable, "-c", "import sys; print('no model here', flush=True); sys.exit(3)"]
    expected = r"exited with 3:\n(.|\n)*no model here"
    with pytest.raises(ServerStartError, match=expected), running_server(argv, free_port()):
        pass


def test_a_server_never_healthy_times_out_and_is_stopped() -> None:
    port = free_port()  # python's http.server answers /health with 404: never healthy
    server = start_server([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], port)
    try:
        with pytest.raises(ServerStartError, match="not healthy after 1 s"):
            server.wait_healthy(1.0)
    finally:
        server.stop()
    assert server.process.poll() is not None and not server.log.exists()  # its temporary log removed


def test_a_healthy_server_is_yielded_then_stopped() -> None:
    port = free_port()
    argv = contbatch_argv("serve", "--backend", "sim", "--cost", "affine:base_ms=5", "--model", "sim", port=port)
    with running_server(argv, port) as server:
        assert server.url == f"http://127.0.0.1:{port}" and server.process.poll() is None
    assert server.process.poll() is not None
