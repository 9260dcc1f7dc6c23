"""Bad input gets a clear 4xx with OpenAI error JSON naming the field, and the server stays healthy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from contbatch.server.serving import ServerConfig
from server.harness import MODEL, RunningServer, start_server

OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LIMIT = 64 * 1024


def completion(**changes: Any) -> dict[str, Any]:
    body = dict(OK)
    for key, value in changes.items():
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def chat(**changes: Any) -> dict[str, Any]:
    body = dict(CHAT)
    body.update(changes)
    return body


_DROP = object()

# (name, path, body: dict -> JSON, bytes -> raw, headers, status, param or None when not checked)
CASES: list[tuple[str, str, Any, dict[str, str], int, str | None]] = [
    ("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', {}, 400, None),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400, None),
    ("not an object", "/v1/completions", b"[1, 2, 3]", {}, 400, None),
    ("empty body", "/v1/completions", b"", {}, 400, None),
    ("NaN literal", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', {}, 400, None),
    ("deep nesting", "/v1/completions", b"[" * 20_000 + b"]" * 20_000, {}, 400, None),
    ("oversized body", "/v1/completions", {"prompt": "a " * LIMIT}, {}, 413, None),
    ("missing prompt", "/v1/completions", completion(prompt=_DROP), {}, 400, "prompt"),
    ("prompt is a number", "/v1/completions", completion(prompt=5), {}, 400, "prompt"),
    ("empty prompt", "/v1/completions", completion(prompt=""), {}, 400, "prompt"),
    ("blank prompt", "/v1/completions", completion(prompt="   \n "), {}, 400, "prompt"),
    ("batched prompts", "/v1/completions", completion(prompt=["a", "b"]), {}, 400, "prompt"),
    ("negative token id", "/v1/completions", completion(prompt=[1, -1]), {}, 400, "prompt"),
    ("token id beyond vocab", "/v1/completions", completion(prompt=[10**9]), {}, 400, "prompt"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', {}, 400, "prompt"),
    ("max_tokens 0", "/v1/completions", completion(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", completion(max_tokens="10"), {}, 400, "max_tokens"),
    ("max_tokens float", "/v1/completions", completion(max_tokens=1.5), {}, 400, "max_tokens"),
    ("max_tokens bool", "/v1/completions", completion(max_tokens=True), {}, 400, "max_tokens"),
    ("beyond max_model_len", "/v1/completions", completion(max_tokens=5000), {}, 400, "max_tokens"),
    ("temperature 3", "/v1/completions", completion(temperature=3), {}, 400, "temperature"),
    ("temperature text", "/v1/completions", completion(temperature="hot"), {}, 400, "temperature"),
    ("top_p 0", "/v1/completions", completion(top_p=0), {}, 400, "top_p"),
    ("n 0", "/v1/completions", completion(n=0), {}, 400, "n"),
    ("n 129", "/v1/completions", completion(n=129), {}, 400, "n"),
    ("n text", "/v1/completions", completion(n="2"), {}, 400, "n"),
    ("n float", "/v1/completions", completion(n=2.5), {}, 400, "n"),
    ("chat n 0", "/v1/chat/completions", chat(n=0), {}, 400, "n"),
    ("best_of 3", "/v1/completions", completion(best_of=3), {}, 400, "best_of"),
    ("echo text", "/v1/completions", completion(echo="yes"), {}, 400, "echo"),
    ("echo on chat", "/v1/chat/completions", chat(echo=True), {}, 400, "echo"),
    ("max_tokens 0 without echo", "/v1/completions", completion(max_tokens=0, echo=False), {}, 400, "max_tokens"),
    ("max_tokens -1 with echo", "/v1/completions", completion(max_tokens=-1, echo=True), {}, 400, "max_tokens"),
    ("max_tokens 2**31-1", "/v1/completions", completion(max_tokens=2**31 - 1), {}, 400, "max_tokens"),
    ("max_tokens 2**31", "/v1/completions", completion(max_tokens=2**31), {}, 400, "max_tokens"),
    ("chat max_tokens 2**31-1", "/v1/chat/completions", chat(max_tokens=2**31 - 1), {}, 400, "max_tokens"),
    ("logprobs -1", "/v1/completions", completion(logprobs=-1), {}, 400, "logprobs"),
    ("logprobs 21", "/v1/completions", completion(logprobs=21), {}, 400, "logprobs"),
    ("logprobs true on completions", "/v1/completions", completion(logprobs=True), {}, 400, "logprobs"),
    ("logprobs float", "/v1/completions", completion(logprobs=1.5), {}, 400, "logprobs"),
    ("top_logprobs on completions", "/v1/completions", completion(top_logprobs=2), {}, 400, "top_logprobs"),
    ("chat logprobs number", "/v1/chat/completions", chat(logprobs=5), {}, 400, "logprobs"),
    ("chat top_logprobs 21", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("chat top_logprobs -1", "/v1/chat/completions", chat(logprobs=True, top_logprobs=-1), {}, 400, "top_logprobs"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=3), {}, 400, "top_logprobs"),
    ("logit_bias list", "/v1/completions", completion(logit_bias=[1, 2]), {}, 400, "logit_bias"),
    ("logit_bias non-integer key", "/v1/completions", completion(logit_bias={"abc": 1}), {}, 400, "logit_bias"),
    ("logit_bias negative key", "/v1/completions", completion(logit_bias={"-3": 1}), {}, 400, "logit_bias"),
    ("logit_bias float key", "/v1/completions", completion(logit_bias={"1.5": 1}), {}, 400, "logit_bias"),
    ("logit_bias huge key", "/v1/completions", completion(logit_bias={"9" * 5000: 1}), {}, 400, "logit_bias"),
    ("logit_bias key beyond vocab", "/v1/completions", completion(logit_bias={"10000000": 1}), {}, 400, "logit_bias"),
    ("logit_bias 101", "/v1/completions", completion(logit_bias={"5": 101}), {}, 400, "logit_bias"),
    ("logit_bias -100.5", "/v1/completions", completion(logit_bias={"5": -100.5}), {}, 400, "logit_bias"),
    ("logit_bias text value", "/v1/completions", completion(logit_bias={"5": "up"}), {}, 400, "logit_bias"),
    ("logit_bias bool value", "/v1/completions", completion(logit_bias={"5": True}), {}, 400, "logit_bias"),
    (
        "chat logit_bias 1e400",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1e400}}',
        {},
        400,
        "logit_bias",
    ),
    ("min_p 2", "/v1/completions", completion(min_p=2), {}, 400, "min_p"),
    ("min_p -0.1", "/v1/completions", completion(min_p=-0.1), {}, 400, "min_p"),
    ("min_p text", "/v1/completions", completion(min_p="low"), {}, 400, "min_p"),
    ("top_k -2", "/v1/completions", completion(top_k=-2), {}, 400, "top_k"),
    ("top_k float", "/v1/completions", completion(top_k=1.5), {}, 400, "top_k"),
    ("top_k 2**31", "/v1/completions", completion(top_k=2**31), {}, 400, "top_k"),
    ("repetition_penalty 0", "/v1/completions", completion(repetition_penalty=0), {}, 400, "repetition_penalty"),
    ("repetition_penalty -1", "/v1/completions", completion(repetition_penalty=-1), {}, 400, "repetition_penalty"),
    (
        "repetition_penalty 1e-46",
        "/v1/completions",
        completion(repetition_penalty=1e-46),
        {},
        400,
        "repetition_penalty",
    ),
    ("repetition_penalty 101", "/v1/completions", completion(repetition_penalty=101), {}, 400, "repetition_penalty"),
    ("frequency_penalty -3", "/v1/completions", completion(frequency_penalty=-3), {}, 400, "frequency_penalty"),
    ("frequency_penalty text", "/v1/completions", completion(frequency_penalty="x"), {}, 400, "frequency_penalty"),
    ("chat presence_penalty 2.5", "/v1/chat/completions", chat(presence_penalty=2.5), {}, 400, "presence_penalty"),
    ("seed 2**64", "/v1/completions", completion(seed=2**64), {}, 400, "seed"),
    ("seed -2**63-1", "/v1/completions", completion(seed=-(2**63) - 1), {}, 400, "seed"),
    ("seed float", "/v1/completions", completion(seed=1.5), {}, 400, "seed"),
    ("chat seed 2**70", "/v1/chat/completions", chat(seed=2**70), {}, 400, "seed"),
    ("stop number", "/v1/completions", completion(stop=5), {}, 400, "stop"),
    ("too many stops", "/v1/completions", completion(stop=[f"s{i}" for i in range(17)]), {}, 400, "stop"),
    ("empty stop", "/v1/completions", completion(stop=[""]), {}, 400, "stop"),
    ("stream text", "/v1/completions", completion(stream="yes"), {}, 400, "stream"),
    (
        "stream_options without stream",
        "/v1/completions",
        completion(stream_options={"include_usage": True}),
        {},
        400,
        "stream_options",
    ),
    (
        "include_usage text",
        "/v1/completions",
        completion(stream=True, stream_options={"include_usage": "y"}),
        {},
        400,
        "include_usage",
    ),
    ("ignore_eos text", "/v1/completions", completion(ignore_eos="no"), {}, 400, "ignore_eos"),
    ("priority text", "/v1/completions", completion(priority="high"), {}, 400, "priority"),
    ("seed text", "/v1/completions", completion(seed="x"), {}, 400, "seed"),
    ("presence_penalty 5", "/v1/completions", completion(presence_penalty=5), {}, 400, "presence_penalty"),
    ("model number", "/v1/completions", completion(model=123), {}, 400, "model"),
    ("unknown model", "/v1/completions", completion(model="gpt-17"), {}, 404, "model"),
    ("bad tenant header", "/v1/completions", completion(), {"X-Tenant": "a b"}, 400, "X-Tenant"),
    # admission and access (issue 15): not JSON, too long to tokenize, a tenant the server refuses
    ("text/plain body", "/v1/completions", completion(), {"content-type": "text/plain"}, 415, None),
    ("form body", "/v1/completions", completion(), {"content-type": "application/x-www-form-urlencoded"}, 415, None),
    ("multipart body", "/v1/chat/completions", chat(), {"content-type": "multipart/form-data; boundary=x"}, 415, None),
    ("text/json body", "/v1/completions", completion(), {"content-type": "text/json"}, 415, None),
    ("empty content type", "/v1/chat/completions", chat(), {"content-type": ""}, 415, None),
    ("raw text/plain body", "/v1/completions", b'{"prompt": "a"}', {"content-type": "text/plain"}, 415, None),
    ("prompt beyond the context", "/v1/completions", completion(prompt="abcd " * 12_000), {}, 400, "prompt"),
    (
        "chat beyond the context, untokenized",
        "/v1/chat/completions",
        chat(messages=[{"role": "system", "content": "abcd " * 6_000}, {"role": "user", "content": "efgh " * 6_000}]),
        {},
        400,
        "messages",
    ),
    ("long blank prompt", "/v1/completions", completion(prompt=" \n" * 10_000), {}, 400, "prompt"),
    ("tenant header too long", "/v1/completions", completion(), {"X-Tenant": "t" * 129}, 400, "X-Tenant"),
    ("empty tenant header", "/v1/completions", completion(), {"X-Tenant": ""}, 400, "X-Tenant"),
    ("priority 2**31", "/v1/completions", completion(priority=2**31), {}, 400, "priority"),
    ("chat without messages", "/v1/chat/completions", {"model": MODEL}, {}, 400, "messages"),
    ("chat empty messages", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages"),
    ("chat message not object", "/v1/chat/completions", chat(messages=["hi"]), {}, 400, "messages[0]"),
    (
        "chat bad role",
        "/v1/chat/completions",
        chat(messages=[{"role": "robot", "content": "x"}]),
        {},
        400,
        "messages[0].role",
    ),
    (
        "chat image part",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        {},
        400,
        "messages[0].content[0].type",
    ),
    (
        "chat content number",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": 7}]),
        {},
        400,
        "messages[0].content",
    ),
    ("chat tools", "/v1/chat/completions", chat(tools=[{"type": "function"}]), {}, 400, "tools"),
    (
        "chat json response",
        "/v1/chat/completions",
        chat(response_format={"type": "json_object"}),
        {},
        400,
        "response_format",
    ),
    (
        "chat max_completion_tokens 0",
        "/v1/chat/completions",
        chat(max_completion_tokens=0),
        {},
        400,
        "max_completion_tokens",
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    config = ServerConfig(max_body_bytes=LIMIT, trust_tenant_header=True)
    running = start_server(overrides={"max_model_len": 4096}, server_config=config)
    yield running
    running.stop()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_4xx(
    server: RunningServer, case: tuple[str, str, Any, dict[str, str], int, str | None]
) -> None:
    _, path, body, headers, status, param = case
    if isinstance(body, bytes):
        r = server.post(path, content=body, headers={"content-type": "application/json", **headers})
    else:
        r = server.post(path, json=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
        assert param.split(".")[-1].split("[")[0] in error["message"] or param in error["message"]


def test_unknown_routes_and_methods_get_json_errors(server: RunningServer) -> None:
    r = server.post("/v1/nothing", json={})
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = server.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_server_stays_healthy_after_bad_input(server: RunningServer) -> None:
    for _, path, body, headers, _, _ in CASES:  # all of them again, then a good request
        if isinstance(body, bytes):
            server.post(path, content=body, headers=headers)
        else:
            server.post(path, json=body, headers=headers)
    assert server.get("/health").status_code == 200
    r = server.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    server.wait_idle()
    assert not server.scheduler.requests


def test_a_truncated_upload_does_not_hurt_the_server(server: RunningServer) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    import socket

    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt": ')
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
