"""Per-group results on the command line: `--by`, ``by_tenant`` / ``by_priority`` in JSON, and the
`--policy` shorthand. Run in-process (`main(argv)`); the multi-tenant trace simulates in about a
second."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from contbatch.cli.main import main
from contbatch.cli.options import UsageError, _vary_spec
from contbatch.core import SchedulerConfig

TENANTS = ["heavy", "light-1", "light-2", "light-3", "light-4"]
MULTI_TENANT = ("--trace", "multi-tenant", "--cost", "affine")


def run_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_simulate_multi_tenant_prints_a_per_tenant_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_text(capsys, "simulate", *MULTI_TENANT)
    main_table, _, groups = out.partition("per tenant:")
    assert "makespan (s)" in main_table and groups
    headers = [line.split()[:2] for line in groups.splitlines() if line.startswith("tenant ")]
    assert headers == [["tenant", name] for name in TENANTS]
    assert "per priority:" not in out  # every request has priority 0


def test_seed_trace_has_no_group_tables(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_text(capsys, "compare", "--trace", "seed")
    assert "per tenant:" not in out and "per priority:" not in out
    doc = run_json(capsys, "compare", "--trace", "seed")
    for result in doc["results"].values():  # type: ignore[attr-defined]
        assert "by_tenant" not in result and "by_priority" not in result


def test_by_none_suppresses_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert "per tenant:" not in run_text(capsys, "simulate", *MULTI_TENANT, "--by", "none")
    result = run_json(capsys, "simulate", *MULTI_TENANT, "--by", "none")["results"]["continuous"]  # type: ignore[index]
    assert "by_tenant" not in result


def test_by_forces_one_key(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_text(capsys, "compare", "--trace", "seed", "--by", "priority")
    assert "per priority:" in out and "per tenant:" not in out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("priority 0")] == [
        ["priority", "0", "static"]
    ]
    out = run_text(capsys, "simulate", *MULTI_TENANT, "--by", "priority")
    assert "per priority:" in out and "per tenant:" not in out


def test_json_results_carry_by_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "simulate", *MULTI_TENANT)["results"]["continuous"]  # type: ignore[index]
    by_tenant = result["by_tenant"]
    assert list(by_tenant) == TENANTS
    assert "by_priority" not in result
    assert sum(g["num_requests"] for g in by_tenant.values()) == result["num_requests"]
    assert sum(g["output_throughput"] for g in by_tenant.values()) == pytest.approx(result["output_throughput"])
    assert "p99_ttft_ms" in by_tenant["light-1"]


def test_json_results_carry_by_priority_with_slo(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "simulate", "--trace", "priority-mix", "--cost", "affine", "--slo", "ttft=2")
    result = doc["results"]["continuous"]  # type: ignore[index]
    assert list(result["by_priority"]) == ["0", "1", "2"]
    assert [g["num_requests"] for g in result["by_priority"].values()] == [80, 120, 200]
    assert "slo_attainment" in result["by_priority"]["0"]
    assert "by_tenant" not in result


def test_out_dir_results_hold_the_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *MULTI_TENANT, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    result = json.loads((tmp_path / "results.json").read_text())["results"]["continuous"]
    assert list(result["by_tenant"]) == TENANTS


def _vary_args(**given: str) -> argparse.Namespace:
    return argparse.Namespace(**({"vary": None, "admission": None, "policy": None} | given))


def test_policy_is_a_shorthand_for_vary_queue_order() -> None:
    assert _vary_spec(_vary_args(policy="fcfs, fair")) == ("queue_order", ["fcfs", "fair"])
    assert _vary_spec(_vary_args(admission="reserve")) == ("kv.admission", ["reserve"])
    assert _vary_spec(_vary_args(vary="max_num_seqs=1,2")) == ("max_num_seqs", ["1", "2"])
    assert _vary_spec(_vary_args()) is None
    with pytest.raises(UsageError, match="--policy 'fcfs,fcfs': values repeat"):
        _vary_spec(_vary_args(policy="fcfs,fcfs"))
    with pytest.raises(UsageError, match="--policy ',': expected V1,V2"):
        _vary_spec(_vary_args(policy=","))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--policy", "fcfs", "--vary", "max_num_seqs=1"], "--policy and --vary cannot be combined"),
        (["--policy", "fcfs", "--admission", "reserve"], "--admission and --policy cannot be combined"),
        (["--admission", "reserve", "--vary", "max_num_seqs=1"], "--admission and --vary cannot be combined"),
    ],
)
def test_vary_flags_are_mutually_exclusive(capsys: pytest.CaptureFixture[str], flags: list[str], needle: str) -> None:
    assert main(["compare", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not hasattr(SchedulerConfig(), "queue_order"), reason="SchedulerConfig has no queue_order yet")
def test_compare_policies_per_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "compare", *MULTI_TENANT, "--policy", "fcfs,fair")
    results = doc["results"]
    assert list(results) == ["fcfs", "fair"]  # type: ignore[call-overload]
    for result in results.values():  # type: ignore[attr-defined]
        assert list(result["by_tenant"]) == TENANTS
    assert doc["variants"]["fair"]["config"]["queue_order"] == "fair"  # type: ignore[index]
