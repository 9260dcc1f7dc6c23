"""Bad input to observe, fit and validate --observed: exit code 2 and one line on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contbatch.cli.main import main
from contbatch.cli.observe_cmd import server_config
from contbatch.observe.servers import SERVER_PRESETS
from observe.harness import dead_url


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def observation(tmp_path: Path) -> Path:
    path = tmp_path / "obs.jsonl"
    header = {"format": "contbatch-observation", "version": 1, "target": {}, "plan": {}, "capacity_rps": None}
    request = {"id": "a", "scheduled": 0.0, "send": 0.0, "prompt": 4, "max_tokens": 2, "chunk_ts": [0.1, 0.2],
               "chunk_tokens": [1, 1], "end": 0.2, "finish": "length", "status": 200, "error": ""}  # fmt: skip
    run = {"name": "open-0.50", "kind": "open", "params": {}, "requests": [request]}
    path.write_text(json.dumps(header) + "\n" + json.dumps(run) + "\n")
    return path


def test_observe_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = str(tmp_path / "o.jsonl")
    one_line_error(capsys, ["observe", "--url", dead_url(), "--out", out], "cannot reach")
    one_line_error(capsys, ["observe", "--url", "localhost:1", "--out", out], "--url")
    one_line_error(capsys, ["observe", "--url", dead_url(), "--out", "/no/such/dir/o.jsonl"], "--out")
    one_line_error(capsys, ["observe", "--url", dead_url(), "--out", out, "--open-prompt", "5"], "--open-prompt")
    one_line_error(capsys, ["observe", "--url", dead_url(), "--out", out, "--phases", "nope"], "unknown phase")
    one_line_error(capsys, ["observe", "--url", dead_url(), "--out", out, "--budget-s", "0"], "--budget-s")
    one_line_error(capsys, ["observe", "--url", dead_url(), "--out", out, "--concurrency", "x"], "--concurrency")


def test_fit_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path, observation: Path) -> None:
    out = str(tmp_path / "p.json")
    fit = ["fit", "--out", out, "--server", "vllm"]
    one_line_error(capsys, [*fit, "--observed", str(tmp_path / "missing.jsonl")], "no such observation file")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    one_line_error(capsys, [*fit, "--observed", str(garbage)], "not JSON")
    one_line_error(capsys, ["fit", "--out", out, "--server", "nope", "--observed", str(observation)], "unknown server")
    one_line_error(capsys, [*fit, "--observed", str(observation), "--set", "nope=1"], "--set")
    one_line_error(capsys, [*fit, "--observed", str(observation), "--runs", "bogus"], "--runs")
    one_line_error(capsys, [*fit, "--observed", str(observation), "--runs", "prefill"], "no completed request")


def test_validate_observed_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path, observation: Path) -> None:
    not_fitted = tmp_path / "calibrated.json"
    affine = {"base_ms": 1.0, "prefill_ms": 0.0, "decode_ms": 0.0, "context_ms": 0.0}
    cost = {"model": "affine", "loop_scale": 1.0, "loop_base_ms": 0.0, "loop_request_ms": 0.0,
            "swap_ms_per_block": 0.0, "affine": affine}  # fmt: skip
    not_fitted.write_text(json.dumps({"format": "contbatch-profile", "version": 1, "cost": cost}))
    validate = ["validate", "--observed", str(observation), "--profile"]
    one_line_error(capsys, [*validate, str(not_fitted)], "contbatch fit")
    one_line_error(capsys, [*validate, str(tmp_path / "none.json")], "no such profile")
    one_line_error(capsys, ["validate", "--profile", str(not_fitted)], "--trace")


def test_every_server_preset_is_a_valid_config() -> None:
    for name in SERVER_PRESETS:
        config = server_config(name, [])
        assert config.kv is not None and config.max_num_batched_tokens >= 1
    assert server_config("transformers-cb", []).kv.block_size == 256
    assert server_config("tgi", ["max_num_seqs=4"]).max_num_seqs == 4
