"""The load generator: send every request at its scheduled time, at most `max_concurrency` at once.

The run's clock is `time.monotonic()` seconds minus the run start, so record timestamps are
offsets from the start. Each request waits for its scheduled send time, then for a concurrency
slot (that wait is the client queue time: actual send - scheduled send), then streams. All
requests are tasks of one event loop sharing one HTTP connection pool without its own limit
(a pool limit would queue requests invisibly). The HTTP client is aiohttp, as vLLM's benchmark
client: a streamed event costs it about 35 µs of CPU where httpx took 90 (`benchmarks/bench_client.py`),
and the client shares the machine it measures, or bounds the rate it can measure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from contbatch.bench.client import RequestRecord, Target, send
from contbatch.bench.workload import BenchRequest

# An idle connection is reused for this long at most. uvicorn and llama.cpp's server (cpp-httplib)
# close theirs after 5 s; with aiohttp's default of 15 s, a request sent on a connection the server
# was closing failed ("Can not write request body": once in an engine_vs_peer run, on llama-server
# at Poisson 4/s, where gaps of seconds between requests are common). A request that fails so all
# the same is sent once more (`contbatch.bench.client.STALE_CONNECTION`).
IDLE_CONNECTION_S = 2.0


@dataclass(frozen=True, slots=True)
class RunConfig:
    max_concurrency: int | None = None  # requests in flight at most; None: no limit
    timeout_s: float = 600.0  # per request: connect and between reads
    progress: bool = True  # a tqdm bar on stderr
    lead_s: float = 0.05  # the first send happens this long after the run is set up


async def run(requests: Sequence[BenchRequest], target: Target, config: RunConfig) -> list[RequestRecord]:
    """Send `requests` and return their records, in the same order."""
    records = [
        RequestRecord(r.request_id, r.send_offset_s, r.num_prompt_tokens, r.max_tokens, r.priority, r.tenant)
        for r in requests
    ]
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    pool = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=IDLE_CONNECTION_S)  # (0: no limit)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.timeout_s, sock_read=config.timeout_s)
    async with aiohttp.ClientSession(connector=pool, timeout=timeout, trust_env=True) as http:
        await _warm_up(http, target)  # connection set-up and first-call costs before the clock starts
        start = time.monotonic() + config.lead_s
        bar = _progress(len(requests), config.progress)

        def clock() -> float:
            return time.monotonic() - start

        async def one(spec: BenchRequest, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, spec.send_offset_s - clock()))
            async with slots if slots is not None else contextlib.nullcontext():
                await send(http, target, spec, record, clock=clock, cancel_at=spec.cancel_offset_s)
            if bar is not None:
                bar.update(1)

        try:
            await asyncio.gather(*(one(spec, record) for spec, record in zip(requests, records, strict=True)))
        finally:
            if bar is not None:
                bar.close()
    return records


async def _warm_up(http: aiohttp.ClientSession, target: Target) -> None:
    with contextlib.suppress(aiohttp.ClientError, OSError):
        async with http.get(target.models_url) as response:
            await response.read()


class _Bar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> _Bar | None:
    if not enabled:
        return None
    from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

    bar: _Bar = tqdm(total=total, desc="requests", unit="req", leave=False)
    return bar
