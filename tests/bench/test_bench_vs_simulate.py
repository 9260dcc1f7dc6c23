"""`contbatch bench` against `contbatch serve --backend sim` reproduces `contbatch simulate`.

Same trace, same cost model, same scheduler config: the paced simulator behind HTTP must give
the mean TTFT, mean TPOT and output throughput the offline simulator reports, within 5 %. Steps
of 50 ms or more keep HTTP overhead (about a millisecond) small; four running requests at most
make requests queue, as a loaded server does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from contbatch.bench.servers import contbatch_argv, free_port, running_server
from contbatch.cli.main import main
from contbatch.traces import synthetic, write_jsonl

COST = "affine:base_ms=50"
SETS = ["--set", "max_num_seqs=4"]


@pytest.fixture
def served() -> Iterator[str]:
    port = free_port()
    argv = contbatch_argv("serve", "--backend", "sim", "--cost", COST, "--model", "sim", *SETS, port=port)
    with running_server(argv, port) as server:
        yield server.url


def test_bench_against_the_paced_sim_reproduces_simulate(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = synthetic.generate(
        "short", 32, synthetic.poisson(8.0), synthetic.uniform(32, 128), synthetic.uniform(8, 24), seed=3
    )
    path = tmp_path / "short.jsonl"
    write_jsonl(trace, path)

    assert main(["simulate", "--trace", str(path), "--cost", COST, *SETS, "--json"]) == 0
    offline = next(iter(json.loads(capsys.readouterr().out)["results"].values()))

    code = main(
        [
            "bench",
            "--base-url",
            served,
            "--model",
            "sim",
            "--trace",
            str(path),
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "bench.json",
            "--ignore-eos",
            "--continuous-usage-stats",
        ]
    )
    capsys.readouterr()
    assert code == 0
    online = json.loads((tmp_path / "bench.json").read_text())
    assert online["completed"] == offline["completed"] == len(trace)
    assert online["total_output_tokens"] == offline["total_output_tokens"]
    assert online["total_input_tokens"] == offline["total_input_tokens"]
    for key in ("mean_ttft_ms", "mean_tpot_ms", "output_throughput"):
        assert online[key] == pytest.approx(offline[key], rel=0.05), (key, online[key], offline[key])
