"""contbatch.plots: phase segments from timelines, step records, and every plot function
writing a non-empty PNG and SVG (the seed trace, static and continuous side by side)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.core import make_scheduler, seed_config
from contbatch.core.config import KVConfig, SchedulerConfig
from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, summarize
from contbatch.plots import (
    PHASES,
    Segment,
    StepSeries,
    grid_layout,
    plot_capacity,
    plot_grid_metric,
    plot_latency_cdfs,
    plot_request_timeline,
    plot_steps,
    request_segments,
    write_run_plots,
)
from contbatch.sim.cost import AffineCost, UnitCost
from contbatch.sim.loop import SimResult, simulate
from contbatch.traces import load_trace
from contbatch.traces.synthetic import generate, poisson, scale_to_rate, uniform

SEED_CONFIG = dataclasses.replace(seed_config(8), kv=KVConfig(block_size=2, num_blocks=16))


def assert_figures(paths: tuple[Path, Path] | list[Path]) -> None:
    assert paths
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000, path
        if path.suffix == ".png":
            assert data.startswith(b"\x89PNG\r\n\x1a\n")
        else:
            assert path.suffix == ".svg" and b"<svg" in data[:2000]


def run_seed(name: str) -> tuple[SimResult, StepSeries]:
    series = StepSeries()
    sim = simulate(load_trace("seed"), make_scheduler(name, SEED_CONFIG), UnitCost(8), observers=[series])
    return sim, series


@pytest.fixture(scope="module")
def seed_runs() -> dict[str, tuple[SimResult, StepSeries]]:
    return {name: run_seed(name) for name in ("static", "continuous")}


def timeline(
    arrival: float,
    *,
    scheduled: tuple[float, ...] = (),
    preempted: tuple[float, ...] = (),
    tokens: tuple[float, ...] = (),
    finished: float,
    reason: FinishReason = FinishReason.LENGTH,
) -> Timeline:
    tl = Timeline("r", arrival, num_prompt_tokens=4)
    events = [(t, 1, "s") for t in scheduled] + [(t, 2, "p") for t in preempted] + [(t, 3, "t") for t in tokens]
    for ts, _, kind in sorted(events):
        {"s": tl.record_scheduled, "p": tl.record_preempted, "t": tl.record_tokens}[kind](ts)
    tl.record_finished(finished, reason)
    return tl


# -- segments ------------------------------------------------------------------------------


def test_seed_segments_show_static_queueing_and_continuous_admission(
    seed_runs: dict[str, tuple[SimResult, StepSeries]],
) -> None:
    static = {tl.request_id: request_segments(tl) for tl in seed_runs["static"][0].timelines}
    cont = {tl.request_id: request_segments(tl) for tl in seed_runs["continuous"][0].timelines}
    assert static["A"] == cont["A"] == [Segment("prefill", 0, 2), Segment("decode", 2, 6)]
    # C waits for the static batch to drain (TTFT 5, done at 11); continuous admits it on arrival (TTFT 2, done at 8)
    assert static["C"] == [Segment("waiting", 3, 6), Segment("prefill", 6, 8), Segment("decode", 8, 11)]
    assert cont["C"] == [Segment("prefill", 3, 5), Segment("decode", 5, 8)]


def test_preempted_request_is_requeued_then_resumes() -> None:
    tl = timeline(0, scheduled=(1, 7), preempted=(5,), tokens=(3, 4, 9), finished=10)
    assert request_segments(tl) == [
        Segment("waiting", 0, 1),
        Segment("prefill", 1, 3),
        Segment("decode", 3, 5),
        Segment("requeued", 5, 7),
        Segment("decode", 7, 10),
    ]


def test_preempted_before_first_token_prefills_again() -> None:
    tl = timeline(0, scheduled=(0, 4), preempted=(2,), tokens=(6,), finished=6)
    assert [s.phase for s in request_segments(tl)] == ["prefill", "requeued", "prefill"]


def test_never_scheduled_request_only_waits() -> None:
    tl = timeline(2, finished=5, reason=FinishReason.CANCELLED)
    assert request_segments(tl) == [Segment("waiting", 2, 5)]


def test_segments_tile_every_timeline_of_a_preempting_run() -> None:
    trace = generate("p", 40, poisson(20), uniform(64, 256), uniform(16, 128), seed=3)
    config = SchedulerConfig.from_dict({"kv": {"num_blocks": 48, "block_size": 16}}, base=SchedulerConfig())
    sim = simulate(trace, make_scheduler("continuous", config), AffineCost())
    assert sum(len(tl.preempted_ts) for tl in sim.timelines) > 0  # the run exercises requeueing
    for tl in sim.timelines:
        segments = request_segments(tl)
        assert all(s.phase in PHASES and s.end_ts > s.start_ts for s in segments)
        assert segments[0].start_ts == tl.arrival_ts and segments[-1].end_ts == tl.finished_ts
        assert all(a.end_ts == b.start_ts for a, b in itertools.pairwise(segments))


# -- step records ----------------------------------------------------------------------------


def test_step_series_keeps_one_point_per_step(seed_runs: dict[str, tuple[SimResult, StepSeries]]) -> None:
    for sim, series in seed_runs.values():
        records = series.points
        assert len(records) == sim.num_steps
        assert sum(r.duration or 0 for r in records) == sim.busy_time
        assert all(0.0 <= r.kv_usage <= 1.0 for r in records)
        assert max(r.kv_usage for r in records) <= sim.kv_usage_max
        assert [r.time for r in records] == sorted(r.time for r in records)
    first = seed_runs["continuous"][1].points[0]
    assert (first.time, first.num_requests, first.num_tokens, first.duration) == (1.0, 2, 6, 1.0)


def test_step_series_sees_every_step_of_a_skipped_ahead_run() -> None:
    """Decode runs report every step they take: the KV/batch series of the default (skip-ahead)
    simulation is the series of stepping one step at a time, and it covers the whole busy time."""
    trace = load_trace("kv-pressure")
    config = SchedulerConfig(max_num_batched_tokens=2048, kv=KVConfig(num_blocks=2048))
    series = {skip: StepSeries() for skip in (True, False)}
    sims = {
        skip: simulate(trace, make_scheduler("continuous", config), AffineCost(), observers=[s], skip_ahead=skip)
        for skip, s in series.items()
    }
    assert series[True].points == series[False].points
    assert len(series[True].points) == sims[True].num_steps
    assert sum(p.duration or 0.0 for p in series[True].points) == pytest.approx(sims[True].busy_time)


# -- plots -----------------------------------------------------------------------------------


def test_request_timeline_seed_static_and_continuous_side_by_side(
    tmp_path: Path, seed_runs: dict[str, tuple[SimResult, StepSeries]]
) -> None:
    runs = {name: sim.timelines for name, (sim, _) in seed_runs.items()}
    paths = plot_request_timeline(runs, tmp_path, time_unit="tick", title="seed")
    assert [p.name for p in paths] == ["request-timeline.png", "request-timeline.svg"]
    assert_figures(paths)
    svg = paths[1].read_text()
    assert "static: makespan 11 ticks" in svg and "continuous: makespan 8 ticks" in svg


def test_request_timeline_is_byte_identical_for_the_same_input(
    tmp_path: Path, seed_runs: dict[str, tuple[SimResult, StepSeries]]
) -> None:
    runs = {name: sim.timelines for name, (sim, _) in seed_runs.items()}
    first = plot_request_timeline(runs, tmp_path / "a", time_unit="tick")
    second = plot_request_timeline(runs, tmp_path / "b", time_unit="tick")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


def test_request_timeline_marks_preemptions_and_failures(tmp_path: Path) -> None:
    runs = {
        "x": [
            timeline(0, scheduled=(1, 7), preempted=(5,), tokens=(3, 4, 9), finished=10),
            timeline(2, finished=5, reason=FinishReason.CANCELLED),
        ]
    }
    paths = plot_request_timeline(runs, tmp_path, time_unit="s", token_ticks=False)
    assert_figures(paths)
    svg = paths[1].read_text()
    assert "requeued" in svg and "ended unsuccessfully" in svg and "token emitted" not in svg


def test_latency_cdfs(tmp_path: Path, seed_runs: dict[str, tuple[SimResult, StepSeries]]) -> None:
    runs = {name: sim.timelines for name, (sim, _) in seed_runs.items()}
    assert_figures(plot_latency_cdfs(runs, tmp_path, time_unit="tick", slo=SLO(ttft=3)))


def test_kv_and_batch_over_time(tmp_path: Path, seed_runs: dict[str, tuple[SimResult, StepSeries]]) -> None:
    steps = {name: series.points for name, (_, series) in seed_runs.items()}
    assert_figures(plot_steps(steps, tmp_path, time_unit="tick"))
    plain = {"t": [(1.0, 0.5, 2, 6), (2.0, 0.25, 1, 1), (5.0, 0.0, 1, 1)]}  # bare tuples, no durations
    assert_figures(plot_steps(plain, tmp_path / "plain", time_unit="s"))


def test_capacity_curves(tmp_path: Path) -> None:
    trace = generate("c", 30, poisson(1), uniform(32, 256), uniform(16, 64), seed=1)
    curves: dict[str, list[tuple[float, dict[str, object]]]] = {}
    for name in ("static", "continuous"):
        for rate in (2.0, 8.0, 32.0):
            sim = simulate(scale_to_rate(trace, rate), make_scheduler(name, SchedulerConfig()), AffineCost())
            summary = summarize(sim.timelines, time_unit="s", slo=SLO(ttft=0.5))
            curves.setdefault(name, []).append((rate, summary))
    assert_figures(plot_capacity(curves, tmp_path, legend_title="scheduler"))


def test_grid_metric_layouts(tmp_path: Path) -> None:
    rows = [
        {"budget": b, "mode": m, "rate": r, "goodput": r * b / (1 + i)}
        for b in (1, 2)
        for i, m in enumerate(("reserve", "optimistic"))
        for r in (1.0, 2.0)
    ]
    assert grid_layout(["budget", "mode", "rate"], None) == ("rate", "budget", ("mode",))
    assert grid_layout(["budget", "mode"], None) == ("mode", None, ("budget",))
    assert_figures(plot_grid_metric(rows, ["budget", "mode", "rate"], "goodput", tmp_path))
    assert_figures(plot_grid_metric(rows, ["budget", "mode", "rate"], "goodput", tmp_path / "m", x="mode"))
    with pytest.raises(ValueError, match="not one of the grid axes"):
        grid_layout(["budget"], "rate")


def test_write_run_plots_skips_the_timeline_for_large_traces(tmp_path: Path) -> None:
    trace = generate("big", 80, poisson(50), uniform(8, 16), uniform(2, 4), seed=2)
    sim = simulate(trace, make_scheduler("continuous", SchedulerConfig()), AffineCost())
    written = write_run_plots({"continuous": sim.timelines}, tmp_path, time_unit="s")
    assert sorted(p.name for p in written) == ["latency-cdf.png", "latency-cdf.svg"]


def test_importing_plots_does_not_import_matplotlib() -> None:
    probe = "import contbatch.plots, json, sys; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(proc.stdout)
    assert not [m for m in loaded if m == "matplotlib" or m.startswith("matplotlib.")]
    assert not [m for m in loaded if m.startswith("contbatch.sim")]
