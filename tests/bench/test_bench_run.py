"""`contbatch bench` against a real server (the sim backend, in a thread of this process)."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server.harness import MODEL, RunningServer

from contbatch.cli.main import main
from contbatch.traces import Trace, TraceRequest, write_jsonl

VLLM = ("--ignore-eos", "--continuous-usage-stats")  # the extensions contbatch serve (and vLLM) take


def bench_json(capsys: pytest.CaptureFixture[str], server: RunningServer, *args: str) -> dict[str, Any]:
    code = main(["bench", "--base-url", server.base_url, "--model", MODEL, "--disable-tqdm", "--json", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)  # type: ignore[no-any-return]


def samples(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def test_bench_freezes_its_startup_heap(capsys: pytest.CaptureFixture[str], server: RunningServer) -> None:
    """Before its clock starts, the load generator freezes its start-up heap (an oldest-generation
    collection would otherwise walk it mid-run, a pause in every measured latency); the conftest
    thaws it after the test."""
    assert gc.get_freeze_count() == 0
    doc = bench_json(capsys, server, "--num-prompts", "2", "--input-len", "8", "--output-len", "2")
    assert doc["completed"] == 2
    assert gc.get_freeze_count() > 0


def test_metrics_counters_agree_with_the_bench_results(
    capsys: pytest.CaptureFixture[str], server: RunningServer
) -> None:
    doc = bench_json(
        capsys,
        server,
        "--num-prompts",
        "20",
        "--request-rate",
        "40",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--range-ratio",
        "0.5",
        *VLLM,
    )
    server.wait_idle()
    m = samples(server)
    assert doc["completed"] == 20 and doc["failed"] == 0
    assert m[("contbatch:generation_tokens_total", ())] == doc["total_output_tokens"] == sum(doc["output_lens"])
    assert m[("contbatch:prompt_tokens_total", ())] == doc["total_input_tokens"] == sum(doc["input_lens"])
    assert m[("contbatch:request_success_total", (("finished_reason", "length"),))] == doc["completed"]
    assert m[("contbatch:time_to_first_token_seconds_count", ())] == 20
    assert m[("contbatch:e2e_request_latency_seconds_count", ())] == 20
    assert m[("contbatch:inter_token_latency_seconds_count", ())] == sum(len(gaps) for gaps in doc["itls"])
    server_ttft = m[("contbatch:time_to_first_token_seconds_sum", ())] / 20
    assert server_ttft * 1000 <= doc["mean_ttft_ms"]  # the client sees each token a little later
    assert m[("contbatch:num_requests_running", ())] == 0 and m[("contbatch:kv_cache_usage_perc", ())] == 0


def test_saved_results_use_vllm_key_names(
    capsys: pytest.CaptureFixture[str], server: RunningServer, tmp_path: Path
) -> None:
    code = main(
        [
            "bench",
            "--base-url",
            server.base_url,
            "--model",
            MODEL,
            "--disable-tqdm",
            "--num-prompts",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--goodput",
            "ttft:5000",
            "tpot:1000",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "res.json",
            "--endpoint",
            "chat",
            "--ignore-eos",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "mean TTFT" in text or "ttft" in text.lower()
    doc = json.loads((tmp_path / "res.json").read_text())
    for key in (
        "date",
        "backend",
        "model_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
    ):
        assert key in doc, key
    assert doc["backend"] == "openai-chat" and doc["completed"] == 6 and doc["request_goodput"] > 0
    rows = [json.loads(line) for line in (tmp_path / "res.requests.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["finish_reason"] == "length" and row["measured"] for row in rows)
    assert all(len(row["token_ts"]) == 4 and row["http_status"] == 200 for row in rows)


def test_max_concurrency_queues_on_the_client(capsys: pytest.CaptureFixture[str], make_server: Any) -> None:
    server = make_server(cost="affine:base_ms=10")
    doc = bench_json(
        capsys, server, "--num-prompts", "8", "--input-len", "4", "--output-len", "5", "--max-concurrency", "2", *VLLM
    )
    assert doc["completed"] == 8 and doc["max_concurrency"] == 2
    assert doc["max_queue_ms"] > 100  # the last pair waited for three pairs of ~60 ms requests
    assert doc["mean_ttft_ms"] > doc["mean_queue_ms"]  # latency counts from the scheduled send


def test_trace_cancel_times_disconnect_the_client(
    capsys: pytest.CaptureFixture[str], make_server: Any, tmp_path: Path
) -> None:
    server = make_server(cost="affine:base_ms=10")
    trace = Trace(
        "cancels",
        (TraceRequest("keep", 0.0, 4, 5), TraceRequest("drop", 0.0, 4, 1000, cancel_ts=0.2)),
        "s",
        "test",
    )
    write_jsonl(trace, tmp_path / "t.jsonl")
    doc = bench_json(capsys, server, "--trace", str(tmp_path / "t.jsonl"), *VLLM)
    assert doc["finish_reasons"]["cancelled"] == 1 and doc["finish_reasons"]["length"] == 1
    server.wait_idle()
    assert samples(server)[("contbatch:request_cancelled_total", ())] == 1


def test_overload_shows_as_rejected_requests(capsys: pytest.CaptureFixture[str], make_server: Any) -> None:
    # steps of 100 ms: two seats serve a request every 300 ms, so the 20 requests, sent at once,
    # overrun the queue even when a loaded machine sends them slowly (at 10 ms steps a client
    # taking 30 ms a request kept up with the server: 7 rejections in one loaded run)
    server = make_server(cost="affine:base_ms=100", overrides={"max_num_seqs": 2, "lifecycle": {"max_waiting": 2}})
    code = main(
        [
            "bench",
            "--base-url",
            server.base_url,
            "--model",
            MODEL,
            "--disable-tqdm",
            "--json",
            "--num-prompts",
            "20",
            "--input-len",
            "4",
            "--output-len",
            "5",
            *VLLM,
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    reasons = doc["finish_reasons"]
    assert code == 0 and reasons["rejected"] >= 10 and doc["completed"] >= 2
    assert reasons["rejected"] + doc["completed"] == 20
    assert any("HTTP 429" in e for e in doc["errors"])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--request-rate", "0"], "--request-rate"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--goodput", "ttft"], "--goodput"),
        (["--trace", "no-such-trace"], "--trace"),
        (["--trace", "seed"], "seconds"),
        (["--range-ratio", "1.5"], "--range-ratio"),
        (["--header", "nocolon"], "--header"),
        (["--extra-body", "{nope"], "--extra-body"),
        (["--extra-body", "[1]"], "--extra-body"),
    ],
)
def test_bench_refuses_bad_flags(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("contbatch bench: error:") and words in err


def test_an_unreachable_endpoint_fails_every_request(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "--base-url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--num-prompts",
            "2",
            "--disable-tqdm",
            "--json",
            "--timeout",
            "5",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and doc["completed"] == 0 and doc["finish_reasons"]["error"] == 2


def test_plain_openai_requests_by_default(capsys: pytest.CaptureFixture[str], server: RunningServer) -> None:
    """No extension sent: the sim honours its end of sequence, so outputs are at most max_tokens;
    the final usage gives the token counts, and they agree with the server's."""
    doc = bench_json(capsys, server, "--num-prompts", "12", "--input-len", "8", "--output-len", "300")
    server.wait_idle()
    m = samples(server)
    assert doc["completed"] == 12 and doc["extensions"] == []
    assert all(1 <= n <= 300 for n in doc["output_lens"]) and min(doc["output_lens"]) < 300
    assert doc["finish_reasons"]["stop"] >= 1
    assert m[("contbatch:generation_tokens_total", ())] == doc["total_output_tokens"]
    stop = m[("contbatch:request_success_total", (("finished_reason", "stop"),))]
    length = m[("contbatch:request_success_total", (("finished_reason", "length"),))]
    assert (stop, length) == (doc["finish_reasons"]["stop"], doc["finish_reasons"].get("length", 0))


def test_a_trace_with_priorities_sends_them_only_when_asked(
    capsys: pytest.CaptureFixture[str], server: RunningServer, tmp_path: Path
) -> None:
    trace = Trace("prio", (TraceRequest("a", 0.0, 4, 3, priority=1), TraceRequest("b", 0.0, 4, 3)), "s", "test")
    write_jsonl(trace, tmp_path / "t.jsonl")
    code = main(["bench", "--base-url", server.base_url, "--model", MODEL, "--disable-tqdm", "--json",
                 "--trace", str(tmp_path / "t.jsonl")])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0 and "only with --priority" in captured.err
    doc = bench_json(capsys, server, "--trace", str(tmp_path / "t.jsonl"), "--priority", "--extra-body", '{"seed": 3}')
    assert doc["completed"] == 2 and doc["extensions"] == ["priority", "seed"]
