"""`contbatch route`'s gateway in front of real `contbatch serve` apps (the sim backend) and fake
backends: relaying (streams and bodies, both endpoints, /v1/models, errors), health checks that
take a backend out and bring it back, retries before the first byte, cancellation on disconnect,
load scrapes, and its own metrics."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from server.harness import MODEL, RunningServer

from contbatch.gateway.scrape import parse_scrape
from gateway.fakes import FakeBackend
from gateway.harness import RunningApp, RunningGateway, dead_url, metric_values, wait_for

COMPLETION = {"model": MODEL, "prompt": "a b c d", "max_tokens": 6, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a b c d"}], "max_tokens": 6, "ignore_eos": True}
ROUTED = "contbatch:gateway_requests_routed_total"
RETRIES = "contbatch:gateway_retries_total"
ERRORS = "contbatch:gateway_upstream_errors_total"
IN_FLIGHT = "contbatch:gateway_requests_in_flight"
HEALTHY = "contbatch:gateway_backend_healthy"


def stream_lines(url: str, body: dict[str, Any], **kw: Any) -> tuple[int, list[str]]:
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json={**body, "stream": True}, **kw) as response:
        return response.status_code, [line for line in response.iter_lines() if line]


def texts(lines: list[str]) -> str:
    out = []
    for line in lines:
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices", []):
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def test_answers_are_relayed_as_the_backend_gives_them(
    make_server: Callable[..., RunningServer], make_gateway: Callable[..., RunningGateway]
) -> None:
    backends = [make_server(), make_server()]
    gateway = make_gateway([b.base_url for b in backends], router="round_robin")
    direct = backends[0].post("/v1/completions", json=COMPLETION).json()
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        whole = gateway.post(path, json=body)
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"] == direct["usage"]
        status, lines = stream_lines(gateway.base_url + path, {**body, "stream_options": {"include_usage": True}})
        assert status == 200
        assert lines[-1] == "data: [DONE]"
        assert texts(lines) == direct["choices"][0]["text"]
        assert json.loads(lines[-2].removeprefix("data: "))["usage"] == direct["usage"]
    assert gateway.get("/v1/models").json() == backends[0].get("/v1/models").json()
    assert gateway.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    # the backend's own refusals come back as they are (status, OpenAI error body)
    bad = gateway.post("/v1/completions", json={**COMPLETION, "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    status, lines = stream_lines(gateway.base_url + "/v1/completions", {**COMPLETION, "model": "other"})
    assert status == 404 and "does not exist" in lines[0]
    # and the gateway's own
    assert (
        gateway.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    )
    assert gateway.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
    missing = gateway.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "no route GET /v1/nothing"
    assert gateway.get("/health").json() == {"status": "ok", "healthy": 2, "backends": 2}
    values = gateway.metrics()
    assert values[("contbatch:gateway_http_request_errors_total", (("status", "404"),))] >= 2.0
    for backend in gateway.gateway.balancer.backends:
        assert values[(IN_FLIGHT, (("backend", backend),))] == 0.0
        assert values[(HEALTHY, (("backend", backend),))] == 1.0


def test_health_checks_take_a_backend_out_and_bring_it_back(
    serve_app: Callable[[Any], RunningApp], make_gateway: Callable[..., RunningGateway]
) -> None:
    fakes = [FakeBackend("a"), FakeBackend("b")]
    apps = [serve_app(f.app()) for f in fakes]
    gateway = make_gateway([f"a={apps[0].base_url}", f"b={apps[1].base_url}"], router="round_robin",
                           health_interval_s=0.05)  # fmt: skip
    balancer = gateway.gateway.balancer
    fakes[0].healthy = False
    wait_for(lambda: not balancer.is_healthy("a"), what="a out of the rotation")
    assert gateway.metrics()[(HEALTHY, (("backend", "a"),))] == 0.0
    for _ in range(4):
        assert gateway.post("/v1/completions", json=COMPLETION).status_code == 200
    assert (len(fakes[0].seen), len(fakes[1].seen)) == (0, 4)
    fakes[0].healthy = True
    wait_for(lambda: balancer.is_healthy("a"), what="a back in the rotation")
    for _ in range(4):
        assert gateway.post("/v1/completions", json=COMPLETION).status_code == 200
    assert (len(fakes[0].seen), len(fakes[1].seen)) == (2, 6)
    # none in the rotation: /health says so, and a request gets 503 at once
    fakes[0].healthy = fakes[1].healthy = False
    wait_for(lambda: not balancer.healthy, what="every backend out")
    assert gateway.get("/health").status_code == 503
    refused = gateway.post("/v1/completions", json=COMPLETION)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_backend"
    assert gateway.get("/v1/models").status_code == 503


def test_a_backend_down_at_start_is_never_offered(
    make_server: Callable[..., RunningServer], make_gateway: Callable[..., RunningGateway]
) -> None:
    live = make_server()
    gateway = make_gateway([f"dead={dead_url()}", f"live={live.base_url}"], router="round_robin")
    for _ in range(3):
        assert gateway.post("/v1/completions", json=COMPLETION).status_code == 200
    values = gateway.metrics()
    assert values[(HEALTHY, (("backend", "dead"),))] == 0.0
    assert values[(ROUTED, (("backend", "dead"),))] == 0.0
    assert values[(RETRIES, (("backend", "dead"),))] == 0.0


def test_a_refused_connection_is_retried_on_another_backend(
    make_server: Callable[..., RunningServer], make_gateway: Callable[..., RunningGateway]
) -> None:
    """Without health checks the dead backend stays in the rotation: every request the router
    sends there is retried on the live one before any byte reached the client. (A retry is a
    decision of the router too: round robin's turn moves on, so with two backends every request
    tries the dead one first.)"""
    live = make_server()
    gateway = make_gateway([f"dead={dead_url()}", f"live={live.base_url}"], router="round_robin",
                           health_interval_s=0)  # fmt: skip
    answers = [gateway.post("/v1/completions", json=COMPLETION).status_code for _ in range(2)]
    answers += [stream_lines(gateway.base_url + "/v1/chat/completions", CHAT)[0] for _ in range(2)]
    assert answers == [200] * 4
    values = gateway.metrics()
    assert values[(RETRIES, (("backend", "dead"),))] == 4.0
    assert values[(ERRORS, (("backend", "dead"), ("stage", "connect")))] == 4.0
    assert values[(ROUTED, (("backend", "live"),))] == 4.0
    assert values[(RETRIES, (("backend", "live"),))] == 0.0
    assert gateway.gateway.balancer.tracker.num_in_flight == 0


def test_retries_are_bounded(make_gateway: Callable[..., RunningGateway]) -> None:
    gateway = make_gateway([dead_url(), dead_url(), dead_url()], health_interval_s=0, retries=1)
    whole = gateway.post("/v1/completions", json=COMPLETION)
    assert whole.status_code == 502
    assert whole.json()["error"]["code"] == "upstream_error"
    assert "2 backend(s) tried" in whole.json()["error"]["message"]
    status, lines = stream_lines(gateway.base_url + "/v1/completions", COMPLETION)
    assert status == 502 and "upstream_error" in lines[0]  # nothing was sent yet: an error body, not a stream
    assert sum(v for (name, _), v in gateway.metrics().items() if name == RETRIES) == 2.0


def test_a_backend_that_breaks_before_its_first_event_is_retried(
    serve_app: Callable[[Any], RunningApp], make_gateway: Callable[..., RunningGateway]
) -> None:
    """It answered 200, then dropped the connection: nothing reached the client, so the request
    goes to the other backend; a 503 answer is retried the same way."""
    broken, good = FakeBackend("broken", mode="break_before_first"), FakeBackend("good", num_tokens=5)
    gateway = make_gateway([f"broken={serve_app(broken.app()).base_url}", f"good={serve_app(good.app()).base_url}"],
                           router="round_robin", health_interval_s=0)  # fmt: skip
    status, lines = stream_lines(gateway.base_url + "/v1/completions", COMPLETION)
    assert status == 200 and texts(lines) == " x" * 5 and lines[-1] == "data: [DONE]"
    broken.mode = "status:503"
    gateway.gateway.balancer.router._turn = 0  # type: ignore[attr-defined]  # (round robin starts over)
    assert gateway.post("/v1/completions", json=COMPLETION).status_code == 200
    values = gateway.metrics()
    assert values[(ERRORS, (("backend", "broken"), ("stage", "body")))] == 1.0
    assert values[(ERRORS, (("backend", "broken"), ("stage", "status")))] == 1.0
    assert values[(RETRIES, (("backend", "broken"),))] == 2.0
    # the last backend's own 503 goes to the client as it is when no retry is left
    good.mode = "status:503"
    answer = gateway.post("/v1/completions", json=COMPLETION)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "3"


def test_a_stream_broken_after_its_first_event_ends_with_an_error_event(
    serve_app: Callable[[Any], RunningApp], make_gateway: Callable[..., RunningGateway]
) -> None:
    broken = FakeBackend("broken", mode="break_after:2", num_tokens=6)
    gateway = make_gateway([serve_app(broken.app()).base_url], health_interval_s=0)
    status, lines = stream_lines(gateway.base_url + "/v1/completions", COMPLETION)
    assert status == 200
    assert texts(lines[:2]) == " x x"
    error = json.loads(lines[2].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_error" and error["type"] == "server_error"
    assert lines[3:] == ["data: [DONE]"]
    whole = gateway.post("/v1/completions", json=COMPLETION)  # a body is not streamed: it just works
    assert whole.status_code == 200


def test_scrapes_feed_the_routers_view(
    make_server: Callable[..., RunningServer],
    serve_app: Callable[[Any], RunningApp],
    make_gateway: Callable[..., RunningGateway],
) -> None:
    server, bare = make_server(), FakeBackend("bare")
    gateway = make_gateway([f"served={server.base_url}", f"bare={serve_app(bare.app()).base_url}"],
                           router="least_kv", scrape_interval_s=0.05)  # fmt: skip
    tracker = gateway.gateway.balancer.tracker
    wait_for(lambda: tracker.view("served").scrape is not None, what="a scrape of the served backend")
    scrape = tracker.view("served").scrape
    assert scrape is not None and scrape.num_waiting == 0 and scrape.num_running == 0 and scrape.kv_usage == 0.0
    assert tracker.view("bare").scrape is None  # no /metrics: the gateway's own counts
    assert (("contbatch:gateway_backend_scrape_age_seconds", (("backend", "served"),))) in gateway.metrics()
    bare.metrics_text = "vllm:num_requests_waiting 3\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n"
    wait_for(lambda: tracker.view("bare").scrape is not None, what="a scrape of the vLLM-named metrics")
    seen = tracker.view("bare").scrape
    assert seen is not None and (seen.num_waiting, seen.num_running, seen.kv_usage) == (3, 2, 0.5)
    assert parse_scrape(server.get("/metrics").text, 0.0) is not None


def test_a_client_disconnect_cancels_the_request_on_the_backend(
    make_server: Callable[..., RunningServer], make_gateway: Callable[..., RunningGateway]
) -> None:
    """A stream left after three chunks, and a body whose client gave up waiting: the backend
    cancels both (its own disconnect handling), and the gateway forgets them."""
    backend = make_server("affine:base_ms=20")
    gateway = make_gateway([backend.base_url])
    long = {**COMPLETION, "max_tokens": 10_000}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", gateway.base_url + "/v1/completions", json={**long, "stream": True}) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream
        with pytest.raises(httpx.ReadTimeout):
            http.post(gateway.base_url + "/v1/completions", json=long, timeout=0.5)

    def cancelled() -> float:
        return metric_values(backend.get("/metrics").text)[("contbatch:request_cancelled_total", ())]

    wait_for(lambda: cancelled() == 2.0, what="both requests cancelled on the backend")
    backend.wait_idle()
    wait_for(lambda: gateway.gateway.balancer.tracker.num_in_flight == 0, what="the gateway forgot them")
    assert gateway.metrics()[("contbatch:gateway_client_disconnects_total", ())] == 2.0


def test_every_series_is_exported_from_the_start(make_gateway: Callable[..., RunningGateway]) -> None:
    gateway = make_gateway([f"x={dead_url()}"], health_interval_s=0, scrape_interval_s=0)
    values = gateway.metrics()
    for name in (ROUTED, RETRIES, IN_FLIGHT, HEALTHY):
        assert (name, (("backend", "x"),)) in values
    for stage in ("connect", "status", "body"):
        assert values[(ERRORS, (("backend", "x"), ("stage", stage)))] == 0.0
    assert values[("contbatch:gateway_client_disconnects_total", ())] == 0.0


def test_a_body_over_the_limit_gets_413(make_gateway: Callable[..., RunningGateway]) -> None:
    gateway = make_gateway([dead_url()], health_interval_s=0, max_body_bytes=64)
    answer = gateway.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 100})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    assert gateway.metrics()[(ROUTED, (("backend", gateway.gateway.balancer.backends[0]),))] == 0.0
