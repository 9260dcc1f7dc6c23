"""`contbatch bench` against another OpenAI-compatible server: `transformers serve
--continuous-batching`, on a tiny random Llama written into a temporary directory (no network).

transformers' server refuses any request field it does not know with HTTP 422, so this is the
check that bench's default requests are plain OpenAI; with `--ignore-eos` (a vLLM extension)
every request is refused, as asked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from contbatch.bench.servers import (
    TRANSFORMERS_OFFLINE_ENV,
    ServerStartError,
    free_port,
    start_server,
    transformers_serve_argv,
    transformers_serve_missing,
)
from contbatch.cli.main import main
from contbatch.engine.demo import DemoShape, train_tokenizer, write_random_checkpoint, write_tokenizer
from contbatch.engine.demo_corpus import demo_corpus

pytestmark = pytest.mark.slow

SHAPE = DemoShape(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=96,
    vocab_size=400,
    max_position_embeddings=512,
)
STARTUP_TIMEOUT_S = 120.0
NUM_PROMPTS = 6
OUTPUT_LEN = 8


@dataclass(frozen=True)
class Served:
    base_url: str
    model: str  # the checkpoint directory: transformers serve names the model by its path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    missing = transformers_serve_missing()
    if missing is not None:
        pytest.skip(f"transformers serve cannot run here: {missing} (pip install -e '.[dev]')")
    root = tmp_path_factory.mktemp("transformers-serve")
    model = write_random_checkpoint(root / "tiny-llama", SHAPE, seed=0, demo=False)
    write_tokenizer(model, train_tokenizer(SHAPE.vocab_size, demo_corpus(num_lines=1500, lexicon_size=1500)))
    port = free_port()
    # a small paged cache: sized from memory, its set-up takes seconds on a CPU
    argv = transformers_serve_argv(str(model), port=port, num_blocks=64, max_batch_tokens=256)
    env = {**TRANSFORMERS_OFFLINE_ENV, "HF_HOME": str(root / "hf-home")}
    server = start_server(argv, port, env=env, log=root / "serve.log")
    try:
        try:
            server.wait_healthy(STARTUP_TIMEOUT_S, poll_s=0.2)
        except ServerStartError as exc:
            pytest.fail(f"transformers serve: {exc}")
        yield Served(server.url, str(model))
    finally:
        server.stop()


def bench(capsys: pytest.CaptureFixture[str], served: Served, *args: str) -> tuple[int, dict[str, Any]]:
    code = main(
        [
            "bench",
            "--base-url",
            served.base_url,
            "--model",
            served.model,
            "--num-prompts",
            str(NUM_PROMPTS),
            "--input-len",
            "12",
            "--output-len",
            str(OUTPUT_LEN),
            "--timeout",
            "60",
            "--disable-tqdm",
            "--json",
            *args,
        ]
    )
    return code, json.loads(capsys.readouterr().out)


def test_bench_against_transformers_serve(capsys: pytest.CaptureFixture[str], served: Served) -> None:
    """Every request completes on both endpoints, the report makes sense, and the one vLLM
    extension asked for is refused by this server (one test: a second xdist worker would start a
    second server)."""
    for endpoint in ("completions", "chat"):
        check_report(*bench(capsys, served, "--endpoint", endpoint), endpoint)
    # transformers serve refuses `ignore_eos` (422): bench sends it with --ignore-eos only
    code, doc = bench(capsys, served, "--ignore-eos")
    assert code == 1 and doc["completed"] == 0 and doc["extensions"] == ["ignore_eos"]
    assert all("HTTP 422" in e and "ignore_eos" in e for e in doc["errors"]), doc["errors"]


def check_report(code: int, doc: dict[str, Any], endpoint: str) -> None:
    assert code == 0, (endpoint, doc["errors"])
    assert doc["completed"] == NUM_PROMPTS and doc["failed"] == 0 and not any(doc["errors"]), (endpoint, doc)
    assert doc["extensions"] == [] and doc["backend"] == ("openai-chat" if endpoint == "chat" else "openai")
    assert sum(doc["finish_reasons"].get(r, 0) for r in ("length", "stop")) == NUM_PROMPTS
    # lengths from the server's usage: a random model may end early (its EOS), never late
    assert all(1 <= n <= OUTPUT_LEN for n in doc["output_lens"]), doc["output_lens"]
    assert doc["total_output_tokens"] == sum(doc["output_lens"])
    assert all(n > 0 for n in doc["input_lens"]) and doc["total_input_tokens"] == sum(doc["input_lens"])
    assert 0 < doc["mean_ttft_ms"] <= doc["mean_e2el_ms"]
    assert doc["mean_tpot_ms"] >= 0 and doc["duration"] > 0
    assert doc["request_throughput"] > 0 and doc["output_throughput"] > 0
    assert len(doc["ttfts"]) == NUM_PROMPTS
