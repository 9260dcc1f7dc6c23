"""The `contbatch` command line, run as users run it: in a subprocess for exit codes and
output, in-process (`main(argv)`) for the JSON document."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "contbatch.cli.main", *args], check=False, capture_output=True, text=True, timeout=120
    )


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_compare_seed_json_gives_the_specification_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "compare", "--trace", "seed", "--cost", "unit:8")
    static, cont = doc["results"]["static"], doc["results"]["continuous"]  # type: ignore[index]
    assert (static["makespan"], static["padding_waste"], static["output_throughput"]) == (11, 5, 1.0)
    assert (cont["makespan"], cont["padding_waste"], cont["output_throughput"]) == (8, 0, 1.375)
    assert static["per_request"]["ttft"] == {"A": 2, "B": 2, "C": 5}
    assert static["per_request"]["completion"] == {"A": 6, "B": 3, "C": 11}
    assert cont["per_request"]["ttft"] == {"A": 2, "B": 2, "C": 2}
    assert cont["per_request"]["completion"] == {"A": 6, "B": 3, "C": 8}
    for result in (static, cont):
        assert set(result["per_request"]["tpot"].values()) == {1}
        assert result["total_output_tokens"] == 11


def test_demo_text_table_shows_both_schedulers() -> None:
    proc = run_cli("compare", "--trace", "seed", "--cost", "unit:8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split()[:4] == ["makespan", "(ticks)", "11", "8"] for line in lines)
    assert any(line.split()[:5] == ["padding", "waste", "(tokens)", "5", "0"] for line in lines)
    assert any(line.split() == ["C", "5", "1", "11", "2", "1", "8"] for line in lines)


@pytest.mark.slow
def test_azure_code_affine_completes_every_request_deterministically(tmp_path: Path) -> None:
    first = run_cli("simulate", "--trace", "azure-code", "--cost", "affine", "--json")
    second = run_cli("simulate", "--trace", "azure-code", "--cost", "affine", "--json")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout  # byte-identical
    result = json.loads(first.stdout)["results"]["continuous"]
    assert result["num_requests"] == result["completed"] == 8819
    assert result["finish_reasons"]["length"] == 8819


def test_out_dir_holds_results_and_per_request_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--trace", "seed", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "results.json").read_text())["results"]["continuous"]["makespan"] == 8
    rows = [json.loads(line) for line in (tmp_path / "requests-static.jsonl").read_text().splitlines()]
    assert [r["request_id"] for r in rows] == ["A", "B", "C"]
    assert (tmp_path / "requests-continuous.csv").read_text().splitlines()[0].startswith("request_id,")


def test_slo_adds_goodput(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "compare", "--trace", "seed", "--slo", "ttft=2")
    assert doc["results"]["continuous"]["slo_attainment"] == 1.0  # type: ignore[index]
    assert doc["results"]["static"]["slo_attainment"] == pytest.approx(2 / 3)  # type: ignore[index]


def test_set_overrides_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "simulate", "--trace", "seed", "--set", "max_num_seqs=1")
    assert doc["scheduler_config"]["max_num_seqs"] == 1  # type: ignore[index]
    assert doc["results"]["continuous"]["makespan"] > 8  # type: ignore[index]


def test_a_jsonl_file_trace_takes_the_cost_models_clock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "x", "arrival": 0, "prompt_tokens": 3, "output_tokens": 2}\n')
    doc = run_json(capsys, "simulate", "--trace", str(path), "--cost", "unit:4")
    assert doc["results"]["continuous"]["makespan"] == 3  # type: ignore[index]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["compare", "--trace", "nope"], "unknown trace 'nope'"),
        (["compare", "--cost", "warp:9"], "unknown cost model 'warp'"),
        (["compare", "--cost", "unit:0"], "capacity must be a positive integer"),
        (["compare", "--cost", "affine:base=1"], "bad cost parameter"),
        (["compare", "--set", "max_num_seqs"], "expected KEY=VALUE"),
        (["compare", "--set", "token_budget=3"], "unknown field(s) token_budget"),
        (["compare", "--set", "max_num_batched_tokens=-1"], "max_num_batched_tokens must be a positive integer"),
        (["compare", "--set", "skip_blocked=maybe"], "skip_blocked must be true or false"),
        (["compare", "--slo", "ttft=fast"], "not a number"),
        (["compare", "--slo", "latency=1"], "expected ttft=X"),
        (["compare", "--schedulers", "static,magic"], "unknown scheduler magic"),
        (["simulate", "--scheduler", "magic"], "unknown scheduler magic"),
        (["simulate", "--trace", "azure-code", "--cost", "unit:8"], "timed in s units"),
        (["simulate", "--trace", "seed", "--cost", "affine"], "timed in tick units"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args: list[str], needle: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_malformed_trace_file_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "arrival": 0, "prompt_tokens": 3, "output_tokens": 2}\n{"id": "b", "arrival": 1}\n')
    proc = run_cli("simulate", "--trace", str(path))
    assert proc.returncode == 2
    assert "bad.jsonl:2" in proc.stderr and "prompt_tokens" in proc.stderr


@pytest.mark.parametrize("command", [[], ["simulate"], ["compare"]])
def test_every_command_has_help(command: list[str]) -> None:
    proc = run_cli(*command, "--help")
    assert proc.returncode == 0
    assert "usage: contbatch" in proc.stdout


def test_unknown_command_exits_2() -> None:
    assert run_cli("frobnicate").returncode == 2


def test_the_specifications_example_script_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "continuous_batching_simulator.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "static metrics=" in proc.stdout and "continuous metrics=" in proc.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`contbatch ... | head`: the pipe closes after one line; no traceback, exit 0 (not an error)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "contbatch.cli.main", "simulate", "--trace", "azure-code", "--cost",
            "roofline:llama-2-7b@a100", "--per-request", "on"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0
    assert "Traceback" not in err
