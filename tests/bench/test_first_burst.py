"""benchmarks/first_burst.py against real engine servers on the CPU: each burst's row pairs the
client's TTFT with the server's own histograms for the same requests (read from /metrics)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "first_burst.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("first_burst", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_burst_reads_the_servers_own_ttft(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first_burst = _load()
    out = tmp_path / "first_burst.json"
    assert first_burst.main(["--requests", "2", "--reps", "2", "--json-out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert set(document["runs"]) == set(first_burst.FLAG_SETS)
    for run in document["runs"].values():
        assert len(run["bursts"]) == 2
        for burst in run["bursts"]:
            # the server saw exactly this burst's two requests (the warm-up's are outside the window)
            assert burst["time_to_first_token_seconds_count"] == 2
            assert burst["request_queue_time_seconds_count"] == 2
            assert burst["step_duration_seconds_count"] > 0 and burst["steps_busy_s"] > 0
            # the server's window lies inside the client's, request by request
            assert 0 < burst["time_to_first_token_seconds_mean_ms"] <= burst["client_mean_ttft_ms"] + 1.0
            assert sum(burst["ttft_buckets"].values()) > 0
    assert "server TTFT" in capsys.readouterr().out


def test_bad_arguments_are_refused() -> None:
    first_burst = _load()
    for argv in (["--reps", "0"], ["--requests", "0"]):
        with pytest.raises(SystemExit):
            first_burst.main(argv)
