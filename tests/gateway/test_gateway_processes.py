"""`contbatch route` as its own process in front of `contbatch serve` processes: a backend killed
mid-stream ends the client's stream with a clean error event (and leaves the rotation); and the
command's flags (help, bad values exit 2)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator

import httpx
import pytest

from contbatch.bench.servers import contbatch_argv, free_port, running_server
from contbatch.cli.main import build_parser, main
from contbatch.cli.route_cmd import UPSTREAM_KEY_ENV, gateway_config
from gateway.harness import metric_values

Start = Callable[[list[str]], tuple[subprocess.Popen[bytes], str]]


@pytest.fixture
def start() -> Iterator[Start]:
    """Run `contbatch ARGS --port P` in a process, up once its /health answers 200."""
    with contextlib.ExitStack() as stack:

        def run(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
            port = free_port()
            server = stack.enter_context(running_server(contbatch_argv(*args, port=port), port))
            return server.process, server.url

        yield run


def test_a_backend_killed_mid_stream_ends_the_stream_cleanly(start: Start) -> None:
    backend, backend_url = start(["serve", "--backend", "sim", "--cost", "affine:base_ms=20", "--model", "sim"])
    _, url = start(["route", "--backend", f"only={backend_url}", "--health-interval", "0.2"])
    body = {"model": "sim", "prompt": "a b c", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 3:
                os.kill(backend.pid, signal.SIGKILL)  # the backend dies mid-stream
    assert all(json.loads(line.removeprefix("data: "))["choices"] for line in lines[:3])
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_error" and "mid-stream" in error["message"]
    assert lines[-1] == "data: [DONE]"
    assert all("error" not in line for line in lines[:-2])  # one error event, after whole chunks only
    values = metric_values(httpx.get(url + "/metrics").text)
    assert values[("contbatch:gateway_upstream_errors_total", (("backend", "only"), ("stage", "body")))] == 1.0
    assert values[("contbatch:gateway_retries_total", (("backend", "only"),))] == 0.0
    assert values[("contbatch:gateway_requests_in_flight", (("backend", "only"),))] == 0.0
    assert values[("contbatch:gateway_backend_healthy", (("backend", "only"),))] == 0.0  # out of the rotation
    assert httpx.get(url + "/health").status_code == 503


def test_route_help_names_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["route", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--backend", "--router", "--health-interval", "--scrape-interval", "--retries", "--api-key",
                 "--api-keys-file", "--upstream-api-key", "--trust-tenant-header", "least_outstanding"):  # fmt: skip
        assert flag in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "http://a:1", "--router", "best"], "--router: unknown router 'best'"),
        (["--backend", "ftp://a:1"], "expected http(s)://HOST[:PORT]"),
        (["--backend", "http://a:1", "--backend", "http://a:1"], "given twice"),
        (["--backend", "http://a:1", "--retries", "-1"], "retries must be >= 0"),
        (["--backend", "http://a:1", "--health-timeout", "0"], "health_timeout_s must be > 0"),
        (["--backend", "http://a:1", "--upstream-api-key", "a b"], "upstream API key"),
    ],
)
def test_bad_flags_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("contbatch route: error:") and message in err and len(err.strip().splitlines()) == 1


def test_flags_make_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UPSTREAM_KEY_ENV, "sk-env")
    args = build_parser().parse_args(
        [
            "route",
            "--backend",
            "a=http://10.0.0.1:8000/v1/",
            "--backend",
            "http://10.0.0.2:8000",
            "--router",
            "prefix_affinity:load=1.5",
            "--scrape-interval",
            "0.5",
            "--api-key",
            "sk-1",
        ]
    )
    config = gateway_config(args)
    assert [(b.name, b.url) for b in config.backends] == [
        ("a", "http://10.0.0.1:8000"),
        ("10.0.0.2:8000", "http://10.0.0.2:8000"),
    ]
    assert config.router == "prefix_affinity:load=1.5"
    assert config.scrape_interval_s == 0.5
    assert config.upstream_api_key == "sk-env"
    assert config.api_keys is not None and set(config.api_keys) == {"sk-1"}
