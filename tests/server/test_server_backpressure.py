"""Output credits end to end through the SSE writer: it acknowledges each chunk once handed to the
connection, so a reader that stops pulling pauses its request at its credits instead of letting
output pile up; when it reads again the request resumes and finishes."""

from __future__ import annotations

import asyncio
import time

from contbatch.core.status import FinishReason
from contbatch.server.client import DriverClient
from contbatch.server.formats import ResponseMeta
from contbatch.server.protocol import parse_completion
from contbatch.server.serving import ServerConfig, _sse
from contbatch.server.types import SamplingParams, Submission
from server.harness import MODEL, sim_backend

CREDITS = 4


def test_a_stalled_sse_reader_pauses_its_request_at_its_credits() -> None:
    client = DriverClient(sim_backend("affine:base_ms=1", {"lifecycle": {"output_credits": CREDITS}}))
    client.start()
    parsed = parse_completion({"model": MODEL, "prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True})

    async def main() -> tuple[int, int, int, list[bytes]]:
        sub = Submission("r", (1, 2), SamplingParams(max_tokens=200, ignore_eos=True), client.now())
        stream = client.generate(sub)
        assert (await stream.first()).queued
        writer = _sse(stream, ResponseMeta("r", 0, MODEL, False), parsed, ServerConfig())
        chunks = [await anext(writer) for _ in range(3)]  # the reader takes three chunks, then stalls
        # the server runs on to the reader's credits and pauses: waited for, not assumed done after
        # a fixed sleep (a loaded machine may run the driver's thread late)
        deadline = time.monotonic() + 30
        while not client.snapshot().num_paused:
            assert time.monotonic() < deadline, "the request never paused"
            await asyncio.sleep(0.01)
        request = client.driver.scheduler.requests["r"]
        stalled_at, paused = request.num_output_tokens, client.snapshot().num_paused
        await asyncio.sleep(0.3)  # ~300 steps' worth of time, paused
        still = request.num_output_tokens
        chunks += [chunk async for chunk in writer]  # reads again: resumes to the end
        return stalled_at, still, paused, chunks

    stalled_at, still, paused, chunks = asyncio.run(main())
    deadline = time.monotonic() + 5
    while client.snapshot().num_live and time.monotonic() < deadline:
        time.sleep(0.01)
    client.shutdown(0.0)
    assert paused == 1
    assert stalled_at == still <= 3 + CREDITS  # two acked + one in hand, plus the credits: no more
    assert chunks[-1] == b"data: [DONE]\n\n" and len(chunks) == 200 + 1
    assert client.driver.scheduler.stats.paused_time > 0.2
    assert client.driver.scheduler.num_finished == 1
    assert FinishReason.LENGTH.value in chunks[-2].decode()
