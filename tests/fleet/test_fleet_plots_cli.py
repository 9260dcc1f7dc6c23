"""The fleet figures (per-replica load and KV, replicas over time, cost against goodput) and
`contbatch capacity` planning fleets: the cheapest fleet over homogeneous, heterogeneous and
disaggregated candidates, its table, JSON and plot, and the flags' errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contbatch.cli.main import main
from contbatch.core import SchedulerConfig
from contbatch.plots import plot_cost_goodput, plot_fleet_load, plot_replica_count
from contbatch.sim.autoscale import AutoscaleConfig
from contbatch.sim.cluster import simulate_cluster
from contbatch.sim.cluster_config import FleetSpec, PoolSpec
from contbatch.sim.cost import AffineCost
from contbatch.traces import Trace, TraceRequest


def assert_figures(paths: tuple[Path, Path]) -> None:
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000 and (data.startswith(b"\x89PNG") or b"<svg" in data[:2000])


def test_fleet_figures(tmp_path: Path) -> None:
    scale = AutoscaleConfig(target=2, interval=0.5, provisioning_delay=1.0, scale_down_cooldown=2.0, max_replicas=3)
    pool = PoolSpec("m", AffineCost(base_ms=40), SchedulerConfig(max_num_seqs=2), 1, autoscale=scale)
    trace = Trace("b", tuple(TraceRequest(f"r{i}", 0.05 * i, 64, 30) for i in range(60)), "s", "test")
    result = simulate_cluster(trace, FleetSpec((pool,)), sample_interval=0.25)
    assert_figures(plot_fleet_load(result.load_series, tmp_path, time_unit="s"))
    assert_figures(plot_replica_count(result.pool_series, tmp_path, time_unit="s"))
    assert_figures(plot_cost_goodput([("1 x a", 1.0, 2.0, False), ("2 x a", 2.0, 3.5, True)], tmp_path))
    with pytest.raises(ValueError, match="at least one"):
        plot_fleet_load([], tmp_path, time_unit="s")


PLAN = ["capacity", "--trace", "long-prompt", "--cost", "roofline:llama-2-7b@a100", "--slo", "ttft=0.5,tpot=0.05"]


def test_capacity_plans_the_cheapest_fleet(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = [*PLAN, "--rate", "60", "--price", "2", "--kind", "5:roofline:llama-2-7b@h100", "--disagg",
            "--json", "--plot", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    document = json.loads(capsys.readouterr().out)
    fleets = document["fleets"]
    shapes = {f["shape"] for f in fleets}
    assert shapes == {"homogeneous", "heterogeneous", "disaggregated"}
    cheapest = document["cheapest"]
    assert cheapest["meets"] and cheapest["price/h"] == min(f["price/h"] for f in fleets if f["meets"])
    assert (tmp_path / "cost-goodput.png").exists()


def test_capacity_fleet_text_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--rate", "8", "--kind", "3:roofline:llama-2-7b@h100"]) == 0
    out = capsys.readouterr().out
    assert "cheapest fleet meeting the target:" in out and "x a100" in out and "x h100" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kind", "3:roofline:llama-2-7b@h100"], "give --rate R"),
        (["--rate", "4", "--kind", "three:affine"], "expected PRICE:COST"),
        (["--rate", "4", "--routing", "fastest"], "unknown router 'fastest'"),
        (["--rate", "4", "--kind", "1:unit:8"], "its clock is tick"),
        (["--rate", "4", "--kind", "1:roofline:llama-2-7b@a100"], "kinds repeat"),
    ],
)
def test_capacity_fleet_errors(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, *extra]) == 2
    assert message in capsys.readouterr().err


def test_capacity_replicas_accepts_any_router(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--rate", "8", "--routing", "prefix_affinity:load=1.5", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["routing"] == "prefix_affinity:load=1.5" and document["replicas_needed"] >= 1
