"""Half of 200 streaming clients disconnect mid-stream: each cancelled request is freed within one
step, the others complete, and nothing leaks (scheduler state and /metrics).

The clients that leave ask for `LEAVER_MAX_TOKENS`, far more than they read: each step is paced
to at least 20 ms, so such a request would need minutes to end by length, and it is cancelled
however slowly a loaded machine runs the clients and the server (with short requests, a client
starved of CPU read its first chunks only after the server had sent them all)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contbatch.core import check_invariants
from contbatch.core.status import FinishReason
from contbatch.loop import StepObserver, StepRecord
from server.harness import MODEL, RunningServer

NUM_CLIENTS = 200
MAX_TOKENS = 30  # of a client that stays
LEAVER_MAX_TOKENS = 10_000  # of a client that leaves: >= 200 s of 20 ms steps
BLOCKS = NUM_CLIENTS * -(-(8 + LEAVER_MAX_TOKENS) // 16)  # 16-token blocks: every request at full length fits


@dataclass
class Recorder(StepObserver):
    """A second observer of the driver's loop: step start/end times, and each finished request's KV
    at its end."""

    scheduler: Any
    steps: list[tuple[float, float]] = field(default_factory=list)
    finished: dict[str, Any] = field(default_factory=dict)
    held_at_finish: dict[str, int] = field(default_factory=dict)

    def on_step(self, record: StepRecord) -> None:
        self.steps.append((record.start_ts, record.end_ts))

    def on_finished(self, request: Any, final: object = None) -> None:
        self.finished[request.request_id] = request
        memory = self.scheduler.memory
        self.held_at_finish[request.request_id] = memory.kv.num_held_blocks(request.request_id)


async def one_client(http: httpx.AsyncClient, url: str, leave_after: int | None) -> dict[str, Any]:
    max_tokens = MAX_TOKENS if leave_after is None else LEAVER_MAX_TOKENS
    body = {"model": MODEL, "prompt": "a b c d e f g h", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    seen = {"chunks": 0, "done": False, "left": False}
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                seen["done"] = True
                break
            if line.startswith("data: "):
                seen["chunks"] += 1
                if leave_after is not None and seen["chunks"] >= leave_after:
                    seen["left"] = True
                    break  # leaving the block closes the connection mid-stream
    return seen


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


@pytest.mark.slow
def test_disconnecting_half_of_200_streams(make_server: Any) -> None:
    server: RunningServer = make_server(
        cost="affine:base_ms=20", overrides={"max_num_seqs": 256, "kv": {"num_blocks": BLOCKS, "block_size": 16}}
    )
    driver = server.client.driver
    recorder = Recorder(driver.scheduler)
    driver.core.observers.append(recorder)
    abort_ts: dict[str, float] = {}
    original_abort = driver.abort

    def timed_abort(request_id: str) -> None:
        abort_ts.setdefault(request_id, time.monotonic())
        original_abort(request_id)

    driver.abort = timed_abort  # type: ignore[method-assign]
    rng = random.Random(7)
    plan = [rng.randint(2, 8) if i % 2 else None for i in range(NUM_CLIENTS)]

    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(limits=limits, timeout=60) as http:
            url = server.base_url + "/v1/completions"
            return await asyncio.gather(*(one_client(http, url, n) for n in plan))

    results = asyncio.run(main())
    server.wait_idle(timeout=60)

    # the clients that stayed got everything
    stayed = [r for r, n in zip(results, plan, strict=True) if n is None]
    assert all(r["done"] and r["chunks"] == MAX_TOKENS for r in stayed)
    left = [r for r in results if r["left"]]
    assert len(left) == NUM_CLIENTS // 2

    # server side: one finished request per client, half cancelled, half complete
    reasons = [r.finish_reason for r in recorder.finished.values()]
    assert len(reasons) == NUM_CLIENTS
    assert reasons.count(FinishReason.CANCELLED) == NUM_CLIENTS // 2
    assert reasons.count(FinishReason.LENGTH) == NUM_CLIENTS // 2

    # each cancelled request was freed within one step of the server seeing its client leave
    for rid, request in recorder.finished.items():
        assert recorder.held_at_finish[rid] == 0
        if request.finish_reason is not FinishReason.CANCELLED:
            continue
        assert rid in abort_ts
        finished_ts = request.timeline.finished_ts
        steps_between = [s for s, _ in recorder.steps if abort_ts[rid] < s < finished_ts]
        assert len(steps_between) <= 1, (rid, abort_ts[rid], finished_ts, steps_between)

    # no leak: scheduler state and /metrics
    scheduler = driver.scheduler
    check_invariants(scheduler)
    assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
    assert scheduler.memory is not None
    assert scheduler.memory.kv.num_free_blocks == scheduler.memory.kv.num_blocks
    assert not driver.core.tracked_ids()
    values = metric_values(server.get("/metrics").text)
    assert values[("contbatch:num_requests_running", ())] == 0
    assert values[("contbatch:num_requests_waiting", ())] == 0
    assert values[("contbatch:kv_cache_usage_perc", ())] == 0
    success = "contbatch:request_success_total"
    assert values[("contbatch:request_cancelled_total", ())] == NUM_CLIENTS // 2
    assert values[(success, (("finished_reason", "length"),))] == NUM_CLIENTS // 2
    assert values[("contbatch:unsent_tokens_total", ())] >= 0
    assert server.get("/health").status_code == 200
