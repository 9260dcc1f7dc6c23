"""`contbatch simulate|compare --plot DIR`: the run's figures, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contbatch.cli.main import build_parser, main
from contbatch.cli.options import resolve
from contbatch.cli.report import run_all


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_compare_seed_plot_writes_timeline_cdfs_and_kv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots"
    assert (
        main(
            ["compare", "--trace", "seed", "--set", "kv.num_blocks=16", "--set", "kv.block_size=2", "--plot", str(out)]
        )
        == 0
    )
    assert "makespan" in capsys.readouterr().out
    stems = ("kv-batch", "latency-cdf", "request-timeline")
    assert names(out) == sorted(f"{stem}.{ext}" for stem in stems for ext in ("png", "svg"))
    assert all(p.stat().st_size > 1000 for p in out.iterdir())


def test_plot_does_not_change_the_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--trace", "seed", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["compare", "--trace", "seed", "--json", "--plot", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == plain


def test_simulate_plot_on_a_large_trace_skips_the_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--trace", "long-prompt", "--cost", "affine", "--plot", str(tmp_path)]
    assert main(argv) == 0
    capsys.readouterr()
    assert names(tmp_path) == ["kv-batch.png", "kv-batch.svg", "latency-cdf.png", "latency-cdf.svg"]


def test_steps_are_recorded_only_when_plotting(tmp_path: Path) -> None:
    parser = build_parser()
    plain = resolve(parser.parse_args(["simulate", "--trace", "seed"]), ("continuous",))
    assert plain.plot_dir is None
    assert run_all(plain)["continuous"].steps == ()
    plotted = resolve(parser.parse_args(["simulate", "--trace", "seed", "--plot", str(tmp_path)]), ("continuous",))
    outcome = run_all(plotted)["continuous"]
    assert len(outcome.steps) == outcome.sim.num_steps == 8
