"""benchmarks/engine_vs_peer.py without servers: arguments, prompt lengths, KV size, medians, ratios, the table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_vs_peer.py"


@pytest.fixture(scope="module")
def evp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_vs_peer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_arguments(evp: ModuleType) -> None:
    args = evp.parse_args([])
    assert args.json_out.name == "engine_vs_peer.json"
    assert evp.parse_args(["--across", "a.json"]).json_out.name == "engine_vs_peer_across.json"  # not a run's
    assert args.reps == 3 and args.server_list == ["contbatch", "transformers", "llama.cpp"]
    assert evp.parse_args(["--quick"]).reps == 1
    assert evp.parse_args(["--quick", "--reps", "2", "--servers", "contbatch"]).reps == 2
    for bad in (["--servers", "vllm"], ["--reps", "0"], ["--kv-tokens", "1000"]):
        with pytest.raises(SystemExit):
            evp.parse_args(bad)


def test_workloads(evp: ModuleType) -> None:
    full = {w.name: w for w in evp.workloads(quick=False)}
    poisson, long = full["poisson"], full["long"]
    assert (poisson.requests, poisson.prompt, poisson.output, poisson.rate) == (48, (128, 384), 128, 4.0)
    assert full["burst"].same_as == "poisson" and full["burst"].rate == float("inf")
    assert (long.requests, long.prompt, long.output, long.rate) == (16, (1024, 1024), 64, 2.0)
    assert len({w.seed for w in full.values()}) == 3  # no workload's prompts are another's
    assert not evp.fits_llama(long) and evp.fits_llama(poisson)


@pytest.mark.parametrize("target", [1, 2, 7, 100, 131, 1024])
def test_words_for_tokens(evp: ModuleType, target: int) -> None:
    def count(n: int) -> int:  # 1.3 tokens a word, like the demo tokenizer
        return (13 * n) // 10

    words = evp.words_for_tokens(target, count)
    assert abs(count(words) - target) <= min(abs(count(n) - target) for n in range(1, 2 * target + 2))


def test_kv_mib(evp: ModuleType) -> None:
    assert evp.kv_mib_for(32768, 6144) == 192
    assert evp.kv_mib_for(24576, 6144) == 144
    with pytest.raises(SystemExit):
        evp.kv_mib_for(1000, 6144)


def _result(tps: float, ttft_ms: float, tpot_ms: float, completed: int = 48) -> dict[str, Any]:
    return {"completed": completed, "failed": 48 - completed, "duration": 10.0, "output_throughput": tps,
            "request_throughput": 4.0, "median_ttft_ms": ttft_ms, "mean_ttft_ms": ttft_ms, "p99_ttft_ms": ttft_ms,
            "mean_tpot_ms": tpot_ms, "median_tpot_ms": tpot_ms, "total_input_tokens": 13000,
            "total_output_tokens": 6144, "errors": []}  # fmt: skip


def test_medians_ratios_and_table(evp: ModuleType) -> None:
    items = evp.workloads(quick=False)
    reps = [
        {"contbatch": {"poisson": _result(300, 200, 70), "burst": _result(460, 2000, 80), "long": _result(90, 300, 40)},
         "transformers": {"poisson": _result(100, 1000, 200), "burst": _result(150, 8000, 250),
                          "long": _result(40, 9000, 100)},
         "llama.cpp": {"error": "llama-server exited with 1"}},
        {"contbatch": {"poisson": _result(320, 220, 72), "burst": _result(480, 2400, 82), "long": _result(86, 400, 42)},
         "transformers": {"poisson": _result(100, 1200, 190), "burst": _result(110, 7000, 260),
                          "long": _result(38, 8000, 110)},
         "llama.cpp": {"error": "llama-server exited with 1"}},
    ]  # fmt: skip
    summary = evp.summarize_reps(items, reps)
    assert summary["medians"]["poisson"]["contbatch"]["output_throughput"] == 310
    assert summary["medians"]["burst"]["transformers"]["median_ttft_ms"] == 7500
    assert summary["medians"]["poisson"]["llama.cpp"] is None
    burst = summary["ratios"]["burst"]["transformers"]
    assert burst["output_throughput"] == pytest.approx(470 / 130)
    assert burst["median_ttft_ms"] == pytest.approx(2200 / 7500)
    verdicts = {t["metric"]: t["met"] for t in burst["targets"]}
    assert verdicts == {"output_throughput": False, "median_ttft_ms": False}
    poisson = {t["metric"]: t["met"] for t in summary["ratios"]["poisson"]["transformers"]["targets"]}
    assert poisson == {"output_throughput": True, "median_ttft_ms": True}  # 310 / 100 >= 3; 210 / 1100 <= 0.2
    assert summary["ratios"]["poisson"]["llama.cpp"] is None
    assert summary["problems"]["poisson"]["llama.cpp"] == "llama-server exited with 1"

    text = evp.table(items, summary, {})
    assert "contbatch / transformers: tok/s 3.62x (target >= 4x: MISSED)" in text
    assert "p50 TTFT 0.29x (target <= 0.2x: MISSED)" in text
    assert "llama-server exited with 1" in text
    assert text.count("contbatch / transformers") == 3 and "contbatch / llama.cpp" not in text


def test_baseline_server(evp: ModuleType, tmp_path: Path) -> None:
    """--baseline adds the `baseline` server: the same contbatch flags, the commit's src on PYTHONPATH."""
    args = evp.parse_args(["--baseline", "HEAD", "--servers", "contbatch"])
    assert args.server_list == ["contbatch", "baseline"]
    with pytest.raises(SystemExit):
        evp.parse_args(["--servers", "contbatch,baseline"])  # baseline without a commit
    src = evp.export_baseline("HEAD", tmp_path)
    assert (src / "contbatch" / "engine" / "serving.py").is_file()
    setup = evp.Setup(Path("/m"), 32768, 192, 2048, 2, Path("/l"), Path("/g"), tmp_path, src)
    assert evp.server_argv("baseline", setup, 1) == evp.server_argv("contbatch", setup, 1)
    with pytest.raises(SystemExit, match="no-such-commit"):
        evp.export_baseline("no-such-commit", tmp_path)


def test_baseline_ratio_line_has_no_target(evp: ModuleType) -> None:
    items = evp.workloads(quick=False)[:1]
    reps = [{"contbatch": {"poisson": _result(330, 200, 70)}, "baseline": {"poisson": _result(300, 250, 75)}}]
    summary = evp.summarize_reps(items, reps)
    assert summary["ratios"]["poisson"]["baseline"]["output_throughput"] == pytest.approx(1.1)
    text = evp.table(items, summary, {})
    assert "contbatch / baseline: tok/s 1.10x; p50 TTFT 0.80x" in text
    assert "transformers" not in text and "llama.cpp" not in text  # not asked for: no rows


def test_baseline_flags(evp: ModuleType, tmp_path: Path) -> None:
    """--baseline-flags gives the baseline server serving flags of its own (none by default)."""
    setup = evp.Setup(Path("/m"), 32768, 192, 2048, 2, Path("/l"), Path("/g"), tmp_path, tmp_path,
                      ("--gather-gap", "0.01"), ("--set", "queue_order=shortest"))  # fmt: skip
    contbatch = evp.server_argv("contbatch", setup, 1)
    assert "--gather-gap" in contbatch and "queue_order=shortest" not in contbatch
    baseline = evp.server_argv("baseline", setup, 1)
    assert "queue_order=shortest" in baseline and "--gather-gap" not in baseline
    assert evp.parse_args(["--baseline", "HEAD", "--baseline-flags", "--gather-gap 0.01"]).baseline_flags


def test_across_runs(evp: ModuleType, tmp_path: Path) -> None:
    """Each target over several runs: each run's ratio, how many met it, the repetitions' pairs."""
    items = evp.workloads(quick=False)[1:2]  # burst
    runs = [
        [{"contbatch": {"burst": _result(600, 1000, 50)}, "transformers": {"burst": _result(120, 5000, 250)}},
         {"contbatch": {"burst": _result(700, 900, 50)}, "transformers": {"burst": _result(140, 6000, 250)}}],
        [{"contbatch": {"burst": _result(500, 1200, 50)}, "transformers": {"burst": _result(125, 5000, 250)}}],
    ]  # fmt: skip
    paths = []
    for i, reps in enumerate(runs):
        summary = evp.summarize_reps(items, reps)
        targets = [{"workload": "burst", "peer": "transformers", "metric": m, "bound": b, "kind": k}
                   for m, b, k in evp.TARGETS[("burst", "transformers")]]  # fmt: skip
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps({"targets": targets, "runs": reps, **summary}))
        paths.append(path)
    text, doc = evp.across_runs(paths)
    ttft = next(t for t in doc["targets"] if t["metric"] == "median_ttft_ms")
    assert ttft["per_run"] == pytest.approx([950 / 5500, 1200 / 5000])  # medians of each run, then the ratio
    assert (ttft["met"], ttft["runs"]) == (1, 2)
    assert sorted(ttft["per_repetition"]) == pytest.approx([900 / 6000, 1000 / 5000, 1200 / 5000])
    assert "burst/transformers median_ttft_ms (target <= 0.2x): runs 0.17, 0.24; met in 1 of 2" in text
    assert "3 repetitions 0.15-0.24, median 0.20" in text


def test_across_runs_names_a_file_it_cannot_read(evp: ModuleType, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    for text in ("{not json", "[1, 2]", '{"targets": []}'):
        bad.write_text(text)
        with pytest.raises(SystemExit, match=r"--across .*bad\.json"):
            evp.across_runs([bad])
    with pytest.raises(SystemExit, match=r"--across .*missing\.json"):
        evp.across_runs([tmp_path / "missing.json"])


def test_arrival_ceiling(evp: ModuleType, tmp_path: Path) -> None:
    """A paced workload caps every server's tokens/s at its planned output over its last arrival;
    the table and --across say how far that lets a throughput ratio go."""
    assert evp.arrival_ceiling([0.0, 1.0, 4.0], 100) == 75.0
    assert evp.arrival_ceiling([0.0, 0.0], 100) is None
    listed = [{"name": "poisson", "rate": "4.0", "output": 128, "arrivals_s": [0.0, 6.144]},
              {"name": "burst", "rate": "inf", "output": 128, "arrivals_s": [0.0, 6.144]}]  # fmt: skip
    ceilings = evp.ceilings_of(listed)
    assert ceilings == {"poisson": pytest.approx(2 * 128 / 6.144), "burst": None}

    items = evp.workloads(quick=False)[:2]
    reps = [{"contbatch": {"poisson": _result(40, 200, 70), "burst": _result(460, 2000, 80)},
             "transformers": {"poisson": _result(10, 1000, 200), "burst": _result(150, 8000, 250)}}]  # fmt: skip
    summary = evp.summarize_reps(items, reps, ceilings)
    text = evp.table(items, summary, {})
    cap = "the arrivals cap every server at 42 out tok/s; contbatch 96% of it; the most a ratio could be: 4.17x"
    assert cap in text
    assert text.count("the arrivals cap") == 1  # not on the all-at-once workload

    targets = [{"workload": w, "peer": "transformers", "metric": m, "bound": b, "kind": k}
               for w in ("poisson", "burst") for m, b, k in evp.TARGETS[(w, "transformers")]]  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"targets": targets, "runs": reps, "workloads": listed, **summary}))
    text, doc = evp.across_runs([path])
    poisson = next(t for t in doc["targets"] if t["workload"] == "poisson" and t["metric"] == "output_throughput")
    assert poisson["per_run_ceiling"] == [pytest.approx(41.67 / 10, rel=1e-3)]
    assert "the most the arrivals allowed: runs 4.17; reachable in 1 of 1" in text
    assert text.count("the most the arrivals allowed") == 1


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_servers_cpu_counts_its_children(evp: ModuleType) -> None:
    """A server that does its work in a child process (`transformers serve` 5 spawns one) is
    charged for it: `tree_ticks` sums the process and its live descendants."""
    import subprocess

    work = "n = 0\nfor i in range(10_000_000): n += i\nprint('done', flush=True)\nimport time; time.sleep(60)"
    launcher = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {work!r}])"
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "done"  # the child's work is over
        fields = Path(f"/proc/{parent.pid}/stat").read_text().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])
        assert evp.tree_ticks(parent.pid) > own + 10  # the child's CPU time (about 100 ticks a second)
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)  # the child, then its launcher
        parent.kill()
        parent.wait()
    assert evp.tree_ticks(parent.pid) == 0  # gone
