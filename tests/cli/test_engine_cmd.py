"""`contbatch generate` and `contbatch run` on the built-in demo model (created once, cached)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "contbatch.cli.main", *args], check=False, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_generate_prints_each_completion_with_timing() -> None:
    proc = run_cli("generate", "Hello there", "Another prompt", "--max-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(length; 5 tokens; ttft ") == 2
    assert "tokens/s" in proc.stdout


@pytest.mark.slow
def test_run_replays_a_trace_through_both_schedulers() -> None:
    proc = run_cli("run", "--trace", "seed-scaled", "--json")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)["results"]
    for name in ("static", "continuous"):
        assert results[name]["completed"] == 3
        assert results[name]["total_output_tokens"] == 160 + 64 + 128


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate", "x", "--kv-cache-memory", "0"], "--kv-cache-memory"),
        (["run", "--schedulers", "magic"], "unknown magic"),
        (["run", "--trace", "nope"], "unknown trace 'nope'"),
        (["generate", "x", "--model", "/nonexistent/dir"], "cannot load the model"),
        (["generate", "x", "--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_bad_engine_flags_are_one_clear_line(args: list[str], needle: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
