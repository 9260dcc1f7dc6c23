"""Running a sweep: a 3 x 3 x 4 grid (token budget x KV admission x rate) on a 12-request trace,
locally in one process, in a process pool, and on a local Ray instance, with identical rows."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from contbatch.cli.main import main
from contbatch.sweep import (
    SweepResult,
    SweepSpec,
    columns,
    document,
    load_sweep,
    rows,
    run_local,
    run_point,
    run_ray,
    text_table,
    write_results,
    write_sweep_plots,
)

from .conftest import WriteSweep

GRID = """
name: small-grid
trace: small.jsonl
cost: affine
preset: engine
set:
  kv.num_blocks: 24       # 384 tokens: tight enough that optimistic admission preempts
  max_num_seqs: 8
rate: [2, 5, 10, 20]
grid:
  max_num_batched_tokens: [64, 128, 256]
  kv.admission: [reserve, optimistic, estimate]
slo: {ttft: 0.5, tpot: 0.05}
"""

BUDGETS, MODES, RATES = (64, 128, 256), ("reserve", "optimistic", "estimate"), (2, 5, 10, 20)


@pytest.fixture
def spec(write_sweep: WriteSweep) -> SweepSpec:
    return load_sweep(write_sweep(GRID))


def test_local_grid_rows_are_in_grid_order_with_the_axis_values(spec: SweepSpec) -> None:
    table = rows(run_local(spec, workers=1, progress=False))
    assert len(table) == 36
    assert [r["point"] for r in table] == list(range(36))
    expected = list(itertools.product(BUDGETS, MODES, RATES))
    assert [(r["max_num_batched_tokens"], r["kv.admission"], r["rate"]) for r in table] == expected
    assert list(table[0]) == columns(spec)
    assert all(r["error"] is None and r["num_requests"] == r["completed"] == 12 for r in table)
    assert all(r["goodput"] is not None and 0 <= r["slo_attainment"] <= 1 for r in table)
    assert all(r["num_preemptions"] == 0 for r in table if r["kv.admission"] == "reserve")  # reserve never preempts
    assert any(r["num_preemptions"] > 0 for r in table)
    # a higher rate squeezes the same requests into less time
    assert table[3]["makespan"] < table[0]["makespan"]


def test_rows_equal_a_direct_simulate_of_the_point(spec: SweepSpec) -> None:
    table = rows(run_local(spec, workers=1, progress=False))
    point = spec.points[17]
    summary = run_point(spec.trace_at(point.rate), spec.task(point))
    assert {m: table[17][m] for m in spec.metrics} == {m: summary[m] for m in spec.metrics}


def test_process_pool_gives_the_same_rows_as_one_process(spec: SweepSpec) -> None:
    one = document(run_local(spec, workers=1, progress=False))
    pool = document(run_local(spec, workers=2, progress=False))
    assert json.dumps(pool) == json.dumps(one)


def test_results_files(tmp_path: Path, spec: SweepSpec) -> None:
    result = run_local(spec, workers=2, progress=False)
    csv_path, json_path = write_results(result, tmp_path / "out")
    doc = json.loads(json_path.read_text())
    assert doc["name"] == "small-grid" and doc["axes"]["rate"] == [2, 5, 10, 20]
    assert doc["rows"] == json.loads(json.dumps(rows(result)))
    with csv_path.open() as handle:
        table = list(csv.reader(handle))
    assert table[0] == columns(spec) and len(table) == 37
    assert table[1][:4] == ["0", "64", "reserve", "2"] and table[1][-1] == ""
    plots = write_sweep_plots(result, tmp_path / "plots")
    assert sorted(p.name for p in plots) == [
        "sweep-capacity.png",
        "sweep-capacity.svg",
        "sweep-goodput.png",
        "sweep-goodput.svg",
    ]
    assert all(p.stat().st_size > 1000 for p in plots)


def test_cli_sweep_writes_tables_and_plots(
    tmp_path: Path, write_sweep: WriteSweep, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_sweep(GRID)
    out, plots = tmp_path / "out", tmp_path / "plots"
    argv = ["sweep", str(path), "--workers", "2", "--out", str(out), "--plot", str(plots), "--metric", "p99_ttft"]
    assert main(argv) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split()[:5] == ["point", "max_num_batched_tokens", "kv.admission", "rate", "p99_ttft_ms"]
    assert len(text) == 37
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.json"]
    assert (plots / "sweep-p99_ttft_ms.png").stat().st_size > 1000
    assert main(["sweep", str(path), "--workers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == json.loads((out / "sweep.json").read_text())["rows"]


def test_cost_and_scheduler_axes(write_sweep: WriteSweep) -> None:
    text = "trace: seed\ncost: [unit:8, unit:16]\nscheduler: [static, continuous]\nmetrics: [makespan]\n"
    spec = load_sweep(write_sweep(text))
    assert spec.axis_names == ("scheduler", "cost")  # top-level lists: scheduler, cost, rate
    table = rows(run_local(spec, workers=1, progress=False))
    found = {(r["scheduler"], r["cost"]): r["makespan"] for r in table}
    assert (found["static", "unit:8"], found["continuous", "unit:8"]) == (11, 8)  # the specification's numbers
    assert spec.points[1].config.max_num_batched_tokens == 16  # the seed preset follows unit:C


@pytest.mark.slow
def test_ray_local_instance_gives_the_same_rows(spec: SweepSpec) -> None:
    ray = pytest.importorskip("ray")
    local = document(run_local(spec, workers=2, progress=False))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = document(run_ray(spec, progress=False))
        assert ray.is_initialized()  # an instance it did not start is left running
    finally:
        ray.shutdown()
    assert on_ray["rows"] == local["rows"]
    assert json.dumps(on_ray) == json.dumps(local)


def test_a_point_that_failed_keeps_its_row(tmp_path: Path, spec: SweepSpec) -> None:
    summaries = [run_point(spec.trace_at(p.rate), spec.task(p)) for p in spec.points[:2]]
    summaries[1] = {"error": "simulation stalled: continuous scheduled nothing at 3.0 with work pending"}
    result = SweepResult(dataclasses.replace(spec, points=spec.points[:2]), tuple(summaries))
    assert result.num_failed == 1
    failed = rows(result)[1]
    assert failed["error"].startswith("simulation stalled") and all(failed[m] is None for m in spec.metrics)
    assert "error: simulation stalled" in text_table(result).splitlines()[2]
    csv_path, _ = write_results(result, tmp_path)
    assert (
        csv_path.read_text()
        .splitlines()[2]
        .endswith(",simulation stalled: continuous scheduled nothing at 3.0 with work pending")
    )
