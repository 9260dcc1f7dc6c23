"""Overload at 10x capacity: the bounded queue answers 429 with Retry-After, the process survives,
and every admitted request finishes."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from server.harness import MODEL, RunningServer

MAX_RUNNING = 8
MAX_WAITING = 8
CAPACITY = MAX_RUNNING + MAX_WAITING


def test_ten_times_capacity_gets_429s_and_admitted_requests_finish(make_server: Any) -> None:
    server: RunningServer = make_server(
        cost="affine:base_ms=10", overrides={"max_num_seqs": MAX_RUNNING, "lifecycle": {"max_waiting": MAX_WAITING}}
    )
    body = {"model": MODEL, "prompt": "x y z", "max_tokens": 10, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=60) as http:
            url = server.base_url + "/v1/completions"
            return await asyncio.gather(*(http.post(url, json=body) for _ in range(10 * CAPACITY)))

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(busy) == len(responses), {r.status_code for r in responses}
    assert len(ok) >= CAPACITY and busy
    for r in busy:
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        assert "waiting queue is full" in error["message"]
    for r in ok:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 10
    server.wait_idle()
    assert server.get("/health").status_code == 200
    assert server.post("/v1/completions", json=body).status_code == 200
    rejected = server.scheduler.stats.rejections
    assert rejected == {"queue_full": len(busy)}


def test_streaming_overload_is_refused_before_the_stream_starts(make_server: Any) -> None:
    server: RunningServer = make_server(
        cost="affine:base_ms=10", overrides={"max_num_seqs": 1, "lifecycle": {"max_waiting": 1}}
    )
    body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True, "stream": True}

    async def one(http: httpx.AsyncClient) -> tuple[int, str]:
        async with http.stream("POST", server.base_url + "/v1/completions", json=body) as r:
            text = (await r.aread()).decode()
            return r.status_code, text

    async def main() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=60) as http:
            return await asyncio.gather(*(one(http) for _ in range(10)))

    results = asyncio.run(main())
    codes = sorted(code for code, _ in results)
    assert codes.count(429) >= 1 and codes.count(200) >= 1
    for code, text in results:
        if code == 200:
            assert text.rstrip().endswith("data: [DONE]")
        else:
            assert '"queue_full"' in text and "data:" not in text
