"""The benchmark's pieces without a server: workloads, stream parsing, records, reports."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contbatch.bench.client import RequestRecord, Target, _Stream
from contbatch.bench.report import (
    BenchError,
    measured,
    parse_goodput,
    request_records,
    summarize_records,
    write_results,
)
from contbatch.bench.workload import WORDS, from_trace, load, prompt_text, synthetic_trace
from contbatch.core.status import FinishReason
from contbatch.server.backends.sim import count_tokens
from contbatch.traces import Trace, TraceError, TraceRequest


def test_prompts_are_one_short_word_per_token() -> None:
    assert all(len(w.encode()) <= 4 for w in WORDS)
    text = prompt_text(300, seed=1, request_id="r")
    assert len(text.split()) == 300 == count_tokens(text)
    assert text == prompt_text(300, seed=1, request_id="r") != prompt_text(300, seed=1, request_id="s")


def test_a_trace_becomes_forced_length_requests() -> None:
    trace = Trace(
        "t",
        (
            TraceRequest("a", 0.0, 5, 7, tenant="x", priority=2, max_output_tokens=9),
            TraceRequest("b", 1.5, 3, 2, cancel_ts=2.0),
        ),
        "s",
        "test",
    )
    a, b = from_trace(trace)
    assert (a.send_offset_s, a.num_prompt_tokens, a.max_tokens, a.tenant, a.priority) == (0.0, 5, 7, "x", 2)
    assert len(a.prompt.split()) == 5
    assert (b.send_offset_s, b.cancel_offset_s) == (1.5, 2.0)
    with pytest.raises(TraceError, match="seconds"):
        from_trace(load("seed", request_rate=None))


def test_synthetic_arrivals() -> None:
    burst = synthetic_trace(20, request_rate=math.inf, input_len=10, output_len=5)
    assert {r.arrival_ts for r in burst.requests} == {0.0}
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in burst.requests} == {(10, 5)}
    poisson = synthetic_trace(400, request_rate=20.0, seed=3)
    rate = (len(poisson) - 1) / poisson.requests[-1].arrival_ts
    assert 16 < rate < 24
    spread = synthetic_trace(200, request_rate=5.0, burstiness=4.0, input_len=100, range_ratio=0.5)
    lengths = {r.num_prompt_tokens for r in spread.requests}
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(lengths) > 20
    rescaled = load("azure-code", request_rate=2.0)
    assert (len(rescaled) - 1) / rescaled.requests[-1].arrival_ts == pytest.approx(2.0)


def sse(obj: object) -> str:
    return "data: " + json.dumps(obj)


def chunk(text: str, completion_tokens: int | None = None, reason: str | None = None) -> str:
    body: dict[str, object] = {"choices": [{"index": 0, "text": text, "finish_reason": reason}]}
    if completion_tokens is not None:
        body["usage"] = {"prompt_tokens": 4, "completion_tokens": completion_tokens}
    return sse(body)


def test_stream_parsing_counts_tokens_from_continuous_usage() -> None:
    record = RequestRecord("r", 0.0, 3, 10)
    times = iter([0.1, 0.2, 0.3, 0.4])
    stream = _Stream(record, lambda: next(times))
    lines = [
        chunk(" a", 1),
        "",
        chunk(" b c", 3),
        chunk(" d", 4, "length"),
        sse({"choices": [], "usage": {}}),
        "data: [DONE]",
    ]
    assert [stream.on_line(line) for line in lines] == [False, False, False, False, False, True]
    stream.close()
    assert record.chunk_ts == [0.1, 0.2, 0.3] and record.chunk_tokens == [1, 2, 1]
    assert record.finish is FinishReason.LENGTH and record.num_prompt_tokens == 4


def test_stream_parsing_without_usage_counts_chunks_then_trusts_the_final_usage() -> None:
    record = RequestRecord("r", 0.0, 3, 10)
    stream = _Stream(record, lambda: 1.0)
    for line in (chunk(" a"), chunk(" b", reason="stop"), sse({"choices": [], "usage": {"completion_tokens": 5}})):
        stream.on_line(line)
    stream.close()
    assert record.chunk_tokens == [1, 4] and record.finish is FinishReason.STOP


def test_an_error_chunk_ends_the_record() -> None:
    record = RequestRecord("r", 0.0, 3, 10)
    stream = _Stream(record, lambda: 1.0)
    assert stream.on_line(sse({"error": {"message": "too slow", "type": "timeout_error"}}))
    assert record.finish is FinishReason.TIMEOUT and record.error == "too slow"


def record(rid: str, scheduled: float, send: float, tokens: list[float], end: float) -> RequestRecord:
    r = RequestRecord(rid, scheduled, 10, len(tokens), send_ts=send, end_ts=end, finish=FinishReason.LENGTH)
    r.chunk_ts = tokens
    r.chunk_tokens = [1] * len(tokens)
    return r


def test_a_record_is_a_timeline_from_the_scheduled_send() -> None:
    tl = record("a", 1.0, 1.5, [2.0, 2.5, 3.0], 3.1).timeline()
    assert tl.arrival_ts == 1.0 and tl.scheduled_ts == [1.5]  # queue time = client queue time
    assert tl.token_ts == [2.0, 2.5, 3.0] and tl.finished_ts == 3.1 and tl.finish_reason is FinishReason.LENGTH
    failed = RequestRecord("b", 2.0, 10, 5, send_ts=2.0, end_ts=2.1, finish=FinishReason.REJECTED).timeline()
    assert failed.finish_reason is FinishReason.REJECTED and not failed.token_ts


def test_summary_measures_from_the_scheduled_send_and_excludes_warmup_and_cooldown() -> None:
    records = [record(f"r{i}", float(i), i + 0.5, [i + 1.0, i + 1.5], i + 1.6) for i in range(10)]
    doc = summarize_records(records, warmup_s=2.0, cooldown_s=3.0, slo=parse_goodput(["ttft:1200"]))
    assert [r.request_id for r in measured(records, warmup_s=2.0, cooldown_s=3.0)] == ["r2", "r3", "r4", "r5", "r6"]
    assert doc["num_prompts"] == 10 and doc["num_excluded"] == 5 and doc["completed"] == 5
    assert doc["mean_ttft_ms"] == pytest.approx(1000.0)  # from the scheduled send, not the actual one
    assert doc["mean_queue_ms"] == pytest.approx(500.0)
    assert doc["mean_tpot_ms"] == pytest.approx(500.0)
    assert doc["request_goodput"] == doc["goodput"] and doc["slo_attainment"] == 1.0
    for key in ("duration", "request_throughput", "output_throughput", "p99_e2el_ms", "ttfts", "itls", "errors"):
        assert key in doc
    with pytest.raises(BenchError, match="no request is left"):
        summarize_records(records, warmup_s=6.0, cooldown_s=6.0)


def test_refused_requests_enter_no_latency_but_are_counted() -> None:
    """Issue 14: an HTTP 429 (sent, so its client timeline has a SCHEDULED event) is reported as
    rejected and left out of every latency: mean E2E is over the requests that ran."""
    records = [record(f"r{i}", float(i), float(i), [i + 1.0, i + 2.0], i + 2.0) for i in range(3)]
    records.append(
        RequestRecord("refused", 0.5, 10, 5, send_ts=0.5, end_ts=0.6, status=429, finish=FinishReason.REJECTED)
    )
    doc = summarize_records(records, slo=parse_goodput(["e2el:10000"]))
    assert doc["num_requests"] == 4 and doc["num_rejected"] == 1 and doc["num_not_run"] == 1
    assert doc["finish_reasons"]["rejected"] == 1 and doc["failed"] == 1  # type: ignore[index]
    assert doc["mean_e2el_ms"] == doc["min_e2el_ms"] == pytest.approx(2000.0)  # not the refusal's 100 ms
    assert doc["max_queue_ms"] == 0.0 and doc["total_input_tokens"] == 30  # its prompt was never processed
    assert doc["slo_attainment"] == pytest.approx(3 / 4)  # a miss for goodput
    json.dumps(doc, allow_nan=False)


def test_goodput_flags() -> None:
    slo = parse_goodput(["ttft:500", "tpot:50", "e2el:10000"])
    assert (slo.ttft, slo.tpot, slo.e2e) == (0.5, 0.05, 10.0)
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(BenchError):
            parse_goodput(bad)


def test_results_and_per_request_rows_are_written(tmp_path: Path) -> None:
    records = [record(f"r{i}", float(i), float(i), [i + 0.1], i + 0.2) for i in range(3)]
    doc = summarize_records(records)
    rows = request_records(records, warmup_s=1.0)
    jsonl = write_results(doc, rows, tmp_path / "out" / "res.json")
    assert json.loads((tmp_path / "out" / "res.json").read_text())["completed"] == 3
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [row["measured"] for row in lines] == [False, True, True]
    assert lines[0]["client_queue_time"] == 0.0 and lines[0]["token_ts"] == [0.1]


def test_requests_are_plain_openai_unless_an_extension_is_asked_for() -> None:
    spec = from_trace(Trace("t", (TraceRequest("a", 0.0, 3, 5, priority=2),), "s", "test"))[0]
    plain = Target("http://h:1", "m").body(spec)
    assert plain == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "prompt": spec.prompt,
        "max_tokens": 5,
    }
    chat = Target("http://h:1", "m", chat=True).body(spec)
    assert chat["messages"] == [{"role": "user", "content": spec.prompt}] and chat["max_completion_tokens"] == 5
    assert "max_tokens" not in chat and "prompt" not in chat
    vllm = Target(
        "http://h:1",
        "m",
        ignore_eos=True,
        continuous_usage_stats=True,
        send_priority=True,
        extra_body={"min_tokens": 5, "temperature": 0.7},
    )
    body = vllm.body(spec)
    assert body["ignore_eos"] is True and body["priority"] == 2 and body["min_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["temperature"] == 0.7  # extra_body goes last
    assert vllm.extensions == [
        "ignore_eos",
        "stream_options.continuous_usage_stats",
        "priority",
        "min_tokens",
        "temperature",
    ]
    assert Target("http://h:1", "m").extensions == []


def test_the_usage_of_a_finishing_chunk_counts_the_rest_of_the_tokens() -> None:
    """transformers serve: text chunks without usage (some of several tokens), then the finish
    chunk with the total usage."""
    record = RequestRecord("r", 0.0, 3, 10)
    times = iter([0.1, 0.2, 0.3])
    stream = _Stream(record, lambda: next(times))
    for line in [chunk("a"), chunk("bc"), chunk("", 5, "length")]:
        assert not stream.on_line(line)
    assert stream.on_line("data: [DONE]")
    stream.close()
    assert record.chunk_tokens == [1, 4] and record.num_output_tokens == 5
    assert record.finish is FinishReason.LENGTH and record.num_prompt_tokens == 4


def test_target_urls() -> None:
    assert Target("http://h:1/v1/", "m").url == "http://h:1/v1/completions"
    assert Target("http://h:1", "m", chat=True).url == "http://h:1/v1/chat/completions"


def test_lines_come_whole_whatever_the_chunks() -> None:
    """A stream's lines, split anywhere (inside a line, between \\r and \\n, inside a UTF-8
    character), are the lines of the whole; the last needs no ending; bad UTF-8 is a ValueError."""
    import asyncio

    from contbatch.bench.client import lines

    whole = 'data: {"text": "é€"}\r\n\r\ndata: [DONE]\nlast'.encode()

    async def read(chunks: list[bytes]) -> list[str]:
        async def source() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return [line async for line in lines(source())]

    expected = ['data: {"text": "é€"}', "", "data: [DONE]", "last"]
    for size in (1, 2, 3, 7, len(whole)):
        assert asyncio.run(read([whole[i : i + size] for i in range(0, len(whole), size)])) == expected
    assert asyncio.run(read([b"a\n", b"", b"b\n"])) == ["a", "b"]
    with pytest.raises(ValueError):
        asyncio.run(read([b"data: \xff\n"]))


def test_a_server_that_stops_sending_is_an_error_not_a_cancellation() -> None:
    """A read that waits longer than the run's timeout is the request's ERROR (aiohttp's read
    timeout is also a TimeoutError, as the trace's cancel time is: the two are told apart)."""
    import asyncio

    from contbatch.bench.runner import RunConfig, run
    from contbatch.bench.workload import BenchRequest

    async def scenario() -> RequestRecord:
        async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            writer.write(head.encode())
            await writer.drain()
            await asyncio.sleep(30)

        server = await asyncio.start_server(stall, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            request = BenchRequest("r", 0.0, "a b", 2, 4)
            config = RunConfig(timeout_s=0.5, progress=False)
            (record,) = await run([request], Target(f"http://127.0.0.1:{port}", "m"), config)
            return record
        finally:
            server.close()

    record = asyncio.run(scenario())
    assert record.status == 200 and record.finish is FinishReason.ERROR
    assert "Timeout" in record.error


def test_a_request_on_a_connection_the_server_closed_is_sent_once_more() -> None:
    """A server that closes each kept-alive connection right after its answer, without saying so
    (no `Connection: close`): the next request, written to that pooled connection, fails before
    any answer, and is sent again on another (aiohttp: "Server disconnected" every other request
    without it). A server that drops every request unanswered still fails each, after one resend."""
    import asyncio

    from contbatch.bench.runner import RunConfig, run
    from contbatch.bench.workload import BenchRequest

    answer = b'data: {"choices": [{"text": "x", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (
        len(answer),
        answer,
    )
    seen = {"requests": 0}

    async def scenario(answering: bool) -> list[RequestRecord]:
        async def serve_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
            await reader.readexactly(length)
            seen["requests"] += 1
            if answering:
                writer.write(reply)
                await writer.drain()
                await asyncio.sleep(0.01)  # the client's next request is on its way on this connection
            writer.close()

        server = await asyncio.start_server(serve_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            requests = [BenchRequest(f"r{i}", 0.0, "a b", 2, 1) for i in range(6)]
            config = RunConfig(max_concurrency=1, progress=False)  # each sent as the one before ends
            return await run(requests, Target(f"http://127.0.0.1:{port}", "m"), config)
        finally:
            server.close()

    records = asyncio.run(scenario(answering=True))
    assert [r.finish for r in records] == [FinishReason.LENGTH] * 6, [r.error for r in records]
    seen["requests"] = 0
    records = asyncio.run(scenario(answering=False))
    assert all(r.finish is FinishReason.ERROR and r.status is None for r in records)
    assert seen["requests"] == 12  # each sent twice
