"""`contbatch sweep` over fleets: a ``fleet:`` section and ``fleet.KEY`` axes run each point on
the cluster simulator (locally, in a process pool or on Ray, the same rows), and a bad fleet key
names itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from contbatch.sweep import SweepError, load_sweep, rows, run_local
from contbatch.traces import write_jsonl
from contbatch.traces.synthetic import generate, poisson, uniform


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    """12 requests in seconds, next to the sweep file."""
    path = tmp_path / "small.jsonl"
    write_jsonl(generate("small", 12, poisson(10), uniform(32, 160), uniform(8, 48), seed=7), path)
    return path


FLEET_SWEEP = """
trace: small.jsonl
cost: affine
preset: engine
slo: {ttft: 1.0}
fleet: {replicas: 2, price: 2.0}
grid:
  fleet.router: [round_robin, least_outstanding, prefix_affinity]
  fleet.replicas: [1, 3]
metrics: [goodput, p99_ttft, num_replicas, replica_seconds, cost]
"""


def test_fleet_axes_run_on_the_cluster_simulator(tmp_path: Path, small_trace: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(FLEET_SWEEP)
    spec = load_sweep(path)
    assert spec.axis_names == ("fleet.router", "fleet.replicas")
    table = rows(run_local(spec, workers=1))
    assert [r["num_replicas"] for r in table] == [1, 3] * 3
    assert all(r["cost"] == pytest.approx(r["replica_seconds"] / 3600 * 2.0) for r in table)
    assert all(r["error"] is None for r in table)
    assert rows(run_local(spec, workers=2)) == table


def test_disaggregated_points(tmp_path: Path, small_trace: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "trace: small.jsonl\ncost: roofline:llama-2-7b@a100\nfleet: {prefill: 1, decode: 1}\n"
        "grid:\n  fleet.decode: [1, 2]\nmetrics: [num_transfers, num_replicas]\n"
    )
    table = rows(run_local(load_sweep(path), workers=1))
    assert [(r["num_replicas"], r["num_transfers"]) for r in table] == [(2, 12), (3, 12)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fleet: {replicas: 0}\n", "fleet: fleet.replicas: expected an integer >= 1"),
        ("grid:\n  fleet.speed: [1, 2]\n", "grid.fleet.speed: unknown fleet axis"),
        ("grid:\n  fleet.router: [best]\n", "fleet.router='best'.*unknown router 'best'"),
    ],
)
def test_bad_fleets(tmp_path: Path, small_trace: Path, text: str, expected: str) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text("trace: small.jsonl\ncost: affine\n" + text)
    with pytest.raises(SweepError, match=expected):
        load_sweep(path)


def test_shape_axis_and_per_point_fleet_figures(tmp_path: Path, small_trace: Path) -> None:
    from contbatch.sweep import write_sweep_plots
    from contbatch.sweep.fleet import point_fleet

    path = tmp_path / "sweep.yaml"
    path.write_text(
        "trace: small.jsonl\ncost: roofline:llama-2-7b@a100\nfleet: {replicas: 2, sample_interval: 0.2}\n"
        'grid:\n  fleet.shape: ["2", "1:1"]\n  fleet.router: [round_robin]\nmetrics: [num_replicas, num_transfers]\n'
    )
    result = run_local(load_sweep(path), workers=1)
    assert [(r["num_replicas"], r["num_transfers"]) for r in rows(result)] == [(2, 0), (2, 12)]
    written = {p.name for p in write_sweep_plots(result, tmp_path / "plots")}
    assert {"fleet-load-0.png", "fleet-replicas-1.svg"} <= written
    base = {"prefill": 1, "decode": 1, "router": "x"}
    assert point_fleet(base, (("fleet.decode", 3), ("fleet.router", "y"))) == {"prefill": 1, "decode": 3, "router": "y"}
    assert point_fleet({"replicas": 4}, (("fleet.shape", "1:3"),)) == {"shape": "1:3"}
