"""`contbatch calibrate`, `contbatch validate` and `--cost profile:PATH` from the command line:
bad input is one clear line and exit code 2; a tiny model goes through calibrate, simulate and
validate end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.calibrate.capacity import workload
from contbatch.cli.main import main
from contbatch.traces.jsonl import write_jsonl


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "contbatch.cli.main", *args], check=False, capture_output=True, text=True, timeout=600
    )


def _one_clear_line(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.fixture
def bad_profiles(tmp_path: Path) -> dict[str, Path]:
    files = {"malformed": "{oops", "fields": json.dumps({"format": "contbatch-profile", "version": 1, "cost": {}})}
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(text)
    paths["missing"] = tmp_path / "absent.json"
    return paths


def _in_process(capsys: pytest.CaptureFixture[str], args: list[str], needle: str) -> None:
    """`main(args)` exits 2 with one line naming the problem (an exception would fail the test)."""
    assert main(args) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    assert not captured.out


@pytest.mark.parametrize(
    ("which", "needle"),
    [("missing", "no such profile file"), ("malformed", "not a JSON profile"), ("fields", "field 'cost.model'")],
)
def test_bad_profiles_are_one_line_everywhere_a_cost_is_taken(
    bad_profiles: dict[str, Path], which: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(bad_profiles[which])
    _in_process(capsys, ["simulate", "--trace", "seed-scaled", "--cost", f"profile:{path}"], needle)
    _in_process(capsys, ["compare", "--trace", "seed-scaled", "--cost", f"profile:{path}"], needle)
    _in_process(capsys, ["capacity", "--trace", "seed-scaled", "--cost", f"profile:{path}", "--slo", "ttft=1"], needle)
    _in_process(capsys, ["validate", "--profile", path, "--trace", "seed-scaled"], needle)


def test_a_bad_profile_prints_no_traceback(bad_profiles: dict[str, Path]) -> None:
    path = str(bad_profiles["fields"])
    _one_clear_line(run_cli("simulate", "--trace", "seed-scaled", "--cost", f"profile:{path}"), "field 'cost.model'")
    _one_clear_line(run_cli("validate", "--profile", path, "--trace", "seed-scaled"), "field 'cost.model'")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["calibrate", "--out", "/nonexistent/dir/p.json"], "no such directory"),
        (["calibrate", "--out", "p.json", "--prefill", "64,128,256"], "must start at 0"),
        (["calibrate", "--out", "p.json", "--decodes", "0,one"], "comma-separated integers"),
        (["calibrate", "--out", "p.json", "--repeats", "1"], "repeats >= 3"),
        (["calibrate", "--out", "p.json", "--threads", "0"], "--threads must be >= 1"),
        (["calibrate", "--out", "p.json", "--clock", "cpu"], "unknown clock 'cpu': use one of wall, thread-cpu"),
        (["calibrate", "--out", "p.json", "--clock", "thread-cpu"], "set threads to 1 (--threads 1), not None"),
        (["calibrate", "--out", "p.json", "--runs", "0"], "--runs >= 1"),
        (["calibrate", "--out", "p.json", "--run-requests", "3"], "--run-requests must be >= 4"),
        (["calibrate", "--out", "p.json", "--model", "/nonexistent/model"], "not a directory"),
        (["calibrate", "--out", "p.json", "--kv-cache-memory", "0"], "--kv-cache-memory"),
    ],
)
def test_bad_calibrate_flags_are_one_clear_line(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _in_process(capsys, args, needle)


def test_a_bad_calibrate_flag_prints_no_traceback() -> None:
    _one_clear_line(run_cli("calibrate", "--out", "p.json", "--context", "0,8"), "context axis must be >= 1")


def test_validate_refuses_an_unknown_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from contbatch.sim.costs.profile import PROFILE_FORMAT

    profile = tmp_path / "p.json"
    cost = {"model": "affine", "loop_scale": 1, "loop_base_ms": 0, "loop_request_ms": 0, "swap_ms_per_block": 0,
            "affine": {"base_ms": 1, "prefill_ms": 0, "decode_ms": 0, "context_ms": 0}}  # fmt: skip
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "cost": cost}))
    _in_process(capsys, ["validate", "--profile", str(profile), "--trace", "nope"], "unknown trace 'nope'")
    _in_process(capsys, ["validate", "--profile", str(profile), "--trace", "seed-scaled", "--replays", "0"],
                "--replays must be >= 1")  # fmt: skip


@pytest.mark.slow  # a calibration and two real-time engine replays: 4 s, 13 s on a loaded machine
def test_calibrate_simulate_and_validate_a_tiny_model(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    grid = ["--prefill", "0,32,96", "--decodes", "0,1,4,16", "--context", "8,48", "--repeats", "3",
            "--clock", "thread-cpu"]  # fmt: skip
    code = main(["calibrate", "--model", str(tiny_model), "--out", str(profile), "--kv-cache-memory", "8",
                 "--threads", "1", "--run-requests", "8", "--runs", "2", "--quiet", *grid])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and profile.is_file() and "<- chosen" in out and "1 threads" in out
    assert "machine speed per engine run (probe, against their mean): x" in out
    assert json.loads(profile.read_text())["grid"]["clock"] == "thread-cpu"
    probe = json.loads(profile.read_text())["speed_probe"]
    assert set(probe) == {"ms", "timed", "run_speeds"} and len(probe["timed"]) == 3 and len(probe["run_speeds"]) == 2
    assert all(set(timed) == set(probe["ms"]) for timed in probe["timed"])  # before, between and after the 2 runs
    trace = tmp_path / "trace.jsonl"
    write_jsonl(workload("check", 10, 40.0, prompt_tokens=(8, 64), output_tokens=(4, 24), seed=5), trace)
    assert main(["simulate", "--trace", str(trace), "--cost", f"profile:{profile}", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    code = main(["validate", "--model", str(tiny_model), "--profile", str(profile), "--trace", str(trace),
                 "--kv-cache-memory", "8", "--replays", "2", "--json", "--plot", str(tmp_path / "img")])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["threads"] == 1 and report["num_requests"] == 10
    assert report["measured"]["completed"] == report["predicted"]["completed"] == 10
    metrics = report["metrics"]
    assert {"mean_ttft_ms", "p99_tpot_ms", "p90_itl_ms", "median_e2el_ms", "makespan"} <= set(metrics)
    replays = report["measured_replays"]
    assert len(replays) == 2
    for key, row in metrics.items():
        assert row["rel_error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
        assert row["measured"] == pytest.approx((replays[0][key] + replays[1][key]) / 2)  # the median of two
    speeds = report["machine_speed_per_replay"]  # each replay at the speeds of its own steps, by kind
    assert report["machine_speed_source"] == "step-kinds" and len(speeds) == 2
    assert all(0.2 < s < 5 for pair in speeds for s in pair)
    by_source = report["machine_speed_per_replay_by_source"]
    assert set(by_source) == {"step-kinds", "steps"} and by_source["step-kinds"] == speeds  # no probe unless asked
    assert all(decode == prefill for decode, prefill in by_source["steps"])
    # the simulator is deterministic: validate's prediction is the plain simulation of the same trace
    assert simulated["results"]["continuous"]["total_output_tokens"] == report["predicted"]["total_output_tokens"]
    assert (tmp_path / "img" / "validation-trace.png").is_file()  # named after the trace
    code = main(["validate", "--model", str(tiny_model), "--profile", str(profile), "--trace", str(trace),
                 "--kv-cache-memory", "8", "--speed-source", "probe", "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["machine_speed_source"] == "probe"
    by_source = report["machine_speed_per_replay_by_source"]
    assert report["machine_speed_per_replay"] == by_source["probe"] and len(by_source["step-kinds"]) == 1
    # without the probe, the prediction is the plain simulation at the profile's speed
    code = main(["validate", "--model", str(tiny_model), "--profile", str(profile), "--trace", str(trace),
                 "--kv-cache-memory", "8", "--no-speed-probe", "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["machine_speed_per_replay"] == []
    plain = simulated["results"]["continuous"]
    assert report["predicted"]["mean_e2el_ms"] == pytest.approx(plain["mean_e2el_ms"])
