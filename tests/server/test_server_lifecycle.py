"""Request lifecycle over HTTP: timeouts, executor failures, shutdown; and the backends' registry."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from contbatch.cli.main import main
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.server.backends import BackendError, BackendOptions, make_backend
from contbatch.server.backends.sim import PacedSimExecutor, SimBackend, count_tokens, tokenize
from server.harness import MODEL, RunningServer, sim_backend

POISON_SEED = 666


class PoisonExecutor(PacedSimExecutor):
    """Fails every step that holds a request submitted with seed 666."""

    def __init__(self, inner: PacedSimExecutor) -> None:
        super().__init__(inner.cost)
        self.poisoned: set[str] = set()

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.poisoned |= {new.request_id for new in out.new_requests if new.params.seed == POISON_SEED}
        if any(c.request_id in self.poisoned for c in out.chunks):
            raise RuntimeError("simulated device fault")
        return super().execute(out)


def poisoned_backend() -> SimBackend:
    backend = sim_backend("affine:base_ms=5")
    backend.executor = PoisonExecutor(backend.executor)
    return backend


def sse_events(server: RunningServer, body: dict[str, Any]) -> tuple[int, list[Any]]:
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        return r.status_code, [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_an_executor_failure_is_a_500_for_its_request_and_the_server_keeps_serving(make_server: Any) -> None:
    server: RunningServer = make_server(backend=poisoned_backend())
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 3}
    r = server.post("/v1/completions", json={**body, "seed": POISON_SEED})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "simulated device fault" in error["message"]
    status, events = sse_events(server, {**body, "seed": POISON_SEED})
    assert status == 200 and events[-1] == "[DONE]" and "simulated device fault" in events[-2]["error"]["message"]
    assert server.post("/v1/completions", json=body).status_code == 200
    assert server.get("/health").status_code == 200
    server.wait_idle()
    assert not server.scheduler.requests and server.client.snapshot().num_failed_steps == 2


def test_ttft_timeout_is_a_504_or_an_error_chunk(make_server: Any) -> None:
    server: RunningServer = make_server(
        cost="affine:base_ms=20", overrides={"max_num_seqs": 1, "lifecycle": {"ttft_timeout": 0.1}}
    )
    # holds the only slot (>= 100 s of 20 ms steps, however slowly a loaded machine runs the two requests
    # below); shut down at the end
    hog = {"model": MODEL, "prompt": "a", "max_tokens": 5000, "ignore_eos": True}
    thread = threading.Thread(target=server.post, args=("/v1/completions",), kwargs={"json": hog})
    thread.start()
    try:
        server_wait_running(server)
        r = server.post("/v1/completions", json={**hog, "max_tokens": 1})
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "timeout_error" and "ttft_timeout" in r.json()["error"]["message"]
        status, events = sse_events(server, {**hog, "max_tokens": 1})
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "timeout_error"
    finally:
        server.client.shutdown(0.1)  # cancels the hog
        thread.join()


def server_wait_running(server: RunningServer) -> None:
    import time

    deadline = time.monotonic() + 30
    while server.client.snapshot().num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_request_timeout_ends_a_stream_midway(make_server: Any) -> None:
    server: RunningServer = make_server(cost="affine:base_ms=20", overrides={"lifecycle": {"request_timeout": 0.3}})
    status, events = sse_events(server, {"model": MODEL, "prompt": "a", "max_tokens": 1000, "ignore_eos": True})
    assert status == 200 and events[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-2]]
    assert texts and all(t == " tok" for t in texts)
    assert "request_timeout" in events[-2]["error"]["message"]
    server.wait_idle()


def test_shutdown_cancels_in_flight_streams_and_refuses_new_requests(make_server: Any) -> None:
    server: RunningServer = make_server(cost="affine:base_ms=10")
    body = {"model": MODEL, "prompt": "a", "max_tokens": 50_000, "ignore_eos": True}
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(zip(("status", "events"), sse_events(server, body), strict=True))
    )
    thread.start()
    server_wait_running(server)
    server.client.shutdown(0.1)
    thread.join(timeout=10)
    assert result["status"] == 200 and result["events"][-1] == "[DONE]"
    assert "shut down" in result["events"][-2]["error"]["message"]
    assert server.get("/health").status_code == 503
    r = server.post("/v1/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_the_engine_backend_refuses_a_checkpoint_it_cannot_load() -> None:
    from contbatch.core.config import PRESETS

    with pytest.raises(BackendError, match="cannot load the model"):
        make_backend("engine", PRESETS["engine"], BackendOptions(model="/nonexistent/checkpoint"))
    with pytest.raises(BackendError, match="unknown backend"):
        make_backend("tpu", PRESETS["engine"])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--backend", "engine", "--model", "/nonexistent/checkpoint"], "cannot load the model"),
        (["--backend", "engine", "--device", "tpu"], "unknown device 'tpu'"),
        (["--backend", "engine", "--dtype", "int8"], "int8"),
        (["--backend", "sim", "--cost", "unit:8"], "seconds"),
        (["--backend", "sim", "--set", "bogus=1"], "bogus"),
        (["--backend", "sim", "--cost", "affine:nope=1"], "nope"),
        (["--backend", "nope"], "unknown backend"),
    ],
)
def test_serve_refuses_bad_flags_with_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("contbatch serve: error:") and words in err


def test_the_sim_token_rule() -> None:
    assert count_tokens("the cat") == 2
    assert count_tokens("hello") == 2  # 5 bytes: two 4-byte pieces
    assert count_tokens("  ") == 0
    assert len(tokenize("a bb ccccc")) == count_tokens("a bb ccccc") == 4
    assert tokenize("same words") == tokenize("same   words")


def test_metrics_parse_and_name_like_vllm(server: RunningServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    assert server.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200
    server.wait_idle()
    names = {f.name for f in text_string_to_metric_families(server.get("/metrics").text)}
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "padding_tokens",
        "unsent_tokens",
    ):
        assert "contbatch:" + name in names, name
