"""Sweep files: what a valid one builds, and one clear error (file and key) for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from contbatch.cli.main import main
from contbatch.sweep import SweepError, load_sweep, parse_sweep, with_plot_metric

from .conftest import WriteSweep

BASE = """
trace: small.jsonl
cost: affine
set: {kv.num_blocks: 64, max_num_seqs: 8}
"""


def error_of(write_sweep: WriteSweep, text: str) -> str:
    path = write_sweep(text)
    with pytest.raises(SweepError) as info:
        load_sweep(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "\n" not in message
    return message[len(str(path)) + 2 :]


def test_grid_axes_and_points_in_product_order(write_sweep: WriteSweep) -> None:
    spec = load_sweep(
        write_sweep(
            BASE
            + """
scheduler: [static, continuous]
rate: [5, 10]
grid:
  max_num_batched_tokens: [256, 512, 1024]
  kv.admission: [reserve, estimate]
"""
        )
    )
    assert spec.axis_names == ("max_num_batched_tokens", "kv.admission", "scheduler", "rate")
    assert len(spec.points) == 3 * 2 * 2 * 2
    assert [p.index for p in spec.points] == list(range(24))
    first, last = spec.points[0], spec.points[-1]
    assert dict(first.values) == {
        "max_num_batched_tokens": 256,
        "kv.admission": "reserve",
        "scheduler": "static",
        "rate": 5,
    }
    assert (first.scheduler, first.rate, first.cost) == ("static", 5.0, "affine")
    assert dict(spec.points[1].values)["rate"] == 10  # the last axis varies fastest
    assert last.config.max_num_batched_tokens == 1024 and last.config.kv is not None
    assert (last.config.kv.admission, last.config.kv.num_blocks, last.config.max_num_seqs) == ("estimate", 64, 8)
    assert spec.trace.name == "small" and spec.time_unit == "s"
    assert spec.trace_at(5.0).requests[-1].arrival_ts == pytest.approx(11 / 5)


def test_defaults_without_grid_and_set_as_key_value_list(tmp_path: Path) -> None:
    spec = parse_sweep("trace: seed\nset: [max_num_seqs=1, kv.num_blocks=4]\n", source="s.yaml", base_dir=tmp_path)
    assert spec.name == "s" and spec.axes == () and len(spec.points) == 1
    point = spec.points[0]
    assert (point.scheduler, point.cost, point.rate) == ("continuous", "unit:8", None)
    assert point.config.max_num_batched_tokens == 8  # the seed preset, token budget = C
    assert point.config.max_num_seqs == 1 and point.config.kv is not None and point.config.kv.num_blocks == 4
    assert spec.plot_metric == "output_throughput" and "p99_ttft_ticks" in spec.metrics


def test_metric_names_may_drop_the_unit(write_sweep: WriteSweep) -> None:
    spec = load_sweep(write_sweep(BASE + "slo: {ttft: 1}\nmetrics: [p99_ttft, goodput]\nplot: {metric: median_tpot}\n"))
    assert spec.metrics == ("p99_ttft_ms", "goodput", "median_tpot_ms")
    assert with_plot_metric(spec, "mean_e2el").metrics[-1] == "mean_e2el_ms"
    with pytest.raises(ValueError, match=r"unknown metric 'goodptu'.*did you mean goodput"):
        with_plot_metric(spec, "goodptu")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cost: affine\n", "trace: missing"),
        (BASE + "grids: {}\n", "grids: unknown key; known: name, trace"),
        (BASE + "grid: [1, 2]\n", "grid: expected a mapping"),
        (BASE + "grid: {max_num_seqs: 4}\n", "grid.max_num_seqs: expected a non-empty list of values, got 4"),
        (BASE + "grid: {max_num_seqs: []}\n", "grid.max_num_seqs: expected a non-empty list"),
        (BASE + "grid: {max_num_seqs: [4, 4]}\n", "grid.max_num_seqs: values repeat"),
        (
            BASE + "grid: {kv.admission: [reserve, sometimes]}\n",
            "grid.kv.admission[1]: scheduler config: kv.admission must be one of",
        ),
        (BASE + "grid: {max_num_seqs: [4, -1]}\n", "grid.max_num_seqs[1]: scheduler config: max_num_seqs must be"),
        (
            BASE + "grid: {no_such_field: [1]}\n",
            "grid.no_such_field[0]: scheduler config: unknown field(s) no_such_field",
        ),
        (BASE + "grid: {gpu.memory: [1]}\n", "grid.gpu.memory: bad config key"),
        (BASE + "grid: {scheduler: [continuous, dynamic]}\n", "grid.scheduler[1]: unknown scheduler 'dynamic'"),
        (BASE + "scheduler: dynamic\n", "scheduler: unknown scheduler 'dynamic'"),
        (BASE + "rate: 2\ngrid: {rate: [1, 2]}\n", "rate: given both at the top level and as grid.rate"),
        (BASE + "rate: [1, -2]\n", "rate[1]: expected a number > 0, got -2"),
        (BASE + "rate: fast\n", "rate: expected a number > 0, got 'fast'"),
        (BASE.replace("affine", "[affine, unit:8]"), "cost: cost models run on different clocks"),
        (BASE.replace("affine", "[affine, 'affine:speed=2']"), "cost[1]: bad cost parameter 'speed=2'"),
        (
            "trace: seed\ncost: affine\n",
            "trace: seed is timed in tick units but the cost model's clock is s; use unit:C",
        ),
        (BASE.replace("small.jsonl", "missing.jsonl"), "trace: "),
        ("trace: seed\ngrid: {kv.admission: [reserve]}\n", "grid.kv.admission: the config has no KV cache"),
        (BASE + "preset: turbo\n", "preset: unknown preset 'turbo'; known: engine, seed"),
        (BASE.replace("max_num_seqs: 8", "max_num_seqs: 0"), "set: scheduler config: max_num_seqs must be"),
        ("trace: seed\nset: [max_num_seqs]\n", "set[0]: expected KEY=VALUE, got 'max_num_seqs'"),
        (BASE + "slo: {ttft: 1, latency: 2}\n", "slo.latency: unknown objective"),
        (BASE + "slo: {ttft: soon}\n", "slo.ttft: expected a number"),
        (BASE + "spec_acceptance: 1.5\n", "spec_acceptance: must be in [0, 1]"),
        (BASE + "seed: 1.5\n", "seed: expected an integer"),
        (BASE + "metrics: [p99_ttft, throughput]\n", "metrics[1]: unknown metric 'throughput'"),
        (BASE + "metrics: [point]\n", "metrics[0]: unknown metric 'point'"),
        (BASE + "metrics: [p99_ttft, 3]\n", "metrics[1]: expected a non-empty string, got 3"),
        (BASE + "plot: {metric: [a]}\n", "plot.metric: expected a non-empty string"),
        (BASE + "plot: {metric: goodput}\n", "plot.metric: unknown metric 'goodput'"),
        (
            BASE + "grid: {max_num_seqs: [1, 2]}\nplot: {x: rate}\n",
            "plot.x: 'rate' is not a grid axis; axes: max_num_seqs",
        ),
        (BASE + "plot: {y: goodput}\n", "plot.y: unknown key; known: metric, x"),
        ("trace: seed\ngrid: {max_num_seqs: [1, 2]\n", "not valid YAML: "),
        ("- trace\n- seed\n", "expected a mapping, got ['trace', 'seed']"),
    ],
)
def test_invalid_sweep_files(write_sweep: WriteSweep, text: str, expected: str) -> None:
    assert error_of(write_sweep, text).startswith(expected)


def test_yaml_syntax_errors_give_the_line(write_sweep: WriteSweep) -> None:
    message = error_of(write_sweep, "trace: seed\ngrid:\n\tmax_num_seqs: [1, 2]\n")
    assert message.startswith("not valid YAML: ") and message.endswith("(line 3, column 1)")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=r"nope\.yaml: cannot read"):
        load_sweep(tmp_path / "nope.yaml")


def test_cli_reports_a_bad_file_with_exit_code_2(write_sweep: WriteSweep, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_sweep(BASE + "grid: {kv.admission: [reserve, sometimes]}\n")
    assert main(["sweep", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"contbatch sweep: error: {path}: grid.kv.admission[1]: ")
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(["--workers", "0"], "--workers must be >= 1"), (["--metric", "nope"], "--metric: unknown metric 'nope'")],
)
def test_cli_bad_flags_exit_2(
    write_sweep: WriteSweep, capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    assert main(["sweep", str(write_sweep(BASE)), *flags]) == 2
    assert expected in capsys.readouterr().err


def test_cli_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml: cannot read" in capsys.readouterr().err


def test_the_shipped_example_is_valid() -> None:
    spec = load_sweep(Path(__file__).resolve().parents[2] / "examples" / "sweep.yaml")
    assert spec.axis_names == ("max_num_batched_tokens", "kv.admission", "rate")
    assert len(spec.points) == 3 * 3 * 4
    assert spec.plot_metric == "goodput" and spec.plot_x == "rate"
