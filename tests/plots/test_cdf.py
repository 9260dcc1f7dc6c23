"""Latency CDFs, issue 14: the TTFT CDF's x-axis labels ran together ("100000125000150000" on
kv-pressure), and a rejected request was drawn with an E2E of 0.

Every CDF panel now has a bounded number of round ticks with compact labels (``125k``), and no
two drawn labels overlap: checked on the label boxes the renderer computes. The samples are the
summary's: requests that ran.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.plots import _figure, cdf, plot_latency_cdfs
from contbatch.plots._figure import compact_label, new_figure, readable_x_ticks, shown_x_tick_labels

MAX_LABELS = 8
MIN_GAP_PX = 2.0


def _timelines(seed: int, top_s: float, n: int = 200) -> list[Timeline]:
    """TTFTs spread from 0 to `top_s` seconds (a run under heavy KV pressure), 5 tokens each."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrival = rng.uniform(0.0, 60.0)
        first = arrival + rng.uniform(0.0, top_s)
        tl = Timeline(f"r{i}", arrival, 16)
        tl.record_scheduled(arrival)
        for k in range(5):
            tl.record_tokens(first + 0.021 * k * (1 + i % 3))
        tl.record_finished(first + 0.1 * (1 + i % 3), FinishReason.LENGTH)
        out.append(tl)
    return out


def _drawn_figure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, runs: dict[str, list[Timeline]]) -> Any:
    captured: list[Any] = []
    real_save = _figure.save

    def save(figure: Any, out_dir: str | Path, stem: str) -> tuple[Path, Path]:
        captured.append(figure)
        return real_save(figure, out_dir, stem)

    monkeypatch.setattr(cdf, "save", save)
    png, _ = plot_latency_cdfs(runs, tmp_path, time_unit="s")
    assert png.stat().st_size > 1000
    (figure,) = captured
    figure.canvas.draw()
    return figure


def _assert_readable(figure: Any, axes: list[Any]) -> None:
    renderer = figure.canvas.get_renderer()
    for ax in axes:
        labels = shown_x_tick_labels(ax)
        texts = [label.get_text() for label in labels]
        assert 2 <= len(labels) <= MAX_LABELS, texts
        assert len(set(texts)) == len(texts), texts  # never two equal labels
        assert ax.xaxis.get_offset_text().get_text() == "", "no offset or 1e8 multiplier"
        boxes = sorted((label.get_window_extent(renderer) for label in labels), key=lambda box: box.x0)
        for left, right in itertools.pairwise(boxes):
            assert right.x0 - left.x1 >= MIN_GAP_PX, texts  # no two labels overlap, or even touch


@pytest.mark.parametrize("top_s", [140.0, 170.0, 1.6e5, 0.9])
def test_cdf_tick_labels_are_bounded_and_never_overlap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, top_s: float
) -> None:
    """TTFTs up to 140 s or 170 s are kv-pressure's case (labels 100000125000150000 ran
    together); 1.6e5 s reaches 1e8 ms (an offset multiplier); 0.9 s is a small range."""
    runs = {"static": _timelines(1, top_s), "continuous": _timelines(2, top_s / 4)}
    figure = _drawn_figure(monkeypatch, tmp_path, runs)
    _assert_readable(figure, figure.axes)


def test_kv_pressure_ttft_labels_are_compact(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    figure = _drawn_figure(monkeypatch, tmp_path, {"static": _timelines(1, 150.0)})
    ttft = figure.axes[0]
    assert ttft.get_title() == "TTFT"
    assert [label.get_text() for label in shown_x_tick_labels(ttft)][-1].endswith("k")


def test_a_narrow_panel_gets_fewer_ticks_not_overlapping_ones() -> None:
    figure = new_figure(2.0, 2.0)
    ax = figure.subplots()
    ax.plot([0.0, 1.234e5], [0.0, 1.0])
    readable_x_ticks(figure, [ax])
    _assert_readable(figure, [ax])


@pytest.mark.parametrize(
    ("value", "ticks", "text"),
    [
        (0.0, (0.0, 50000.0, 100000.0), "0"),
        (125000.0, (0.0, 25000.0, 125000.0), "125k"),
        (12500.0, (0.0, 12500.0, 25000.0), "12.5k"),
        (5000.0, (0.0, 5000.0, 10000.0), "5k"),  # the axis is in thousands: one scale per axis
        (1500.0, (0.0, 500.0, 1500.0), "1500"),
        (1.5e6, (0.0, 1.5e6), "1.5M"),
        (0.30000000000000004, (0.0, 0.1, 0.2, 0.30000000000000004), "0.3"),
        (2.5, (0.0, 2.5, 5.0), "2.5"),
        (5.0, (0.0, 2.5, 5.0), "5.0"),  # the decimals of the finest tick, for every tick
        (12340.5, (12340.0, 12340.5, 12341.0), "12.3405k"),  # a narrow span: labels stay distinct
        (-1000.0, (-1000.0, 0.0), "\N{MINUS SIGN}1000"),
    ],
)
def test_compact_label(value: float, ticks: tuple[float, ...], text: str) -> None:
    assert compact_label(value, ticks) == text


def test_cdf_samples_leave_out_requests_that_did_not_run() -> None:
    """Issue 14: as in the summary, a rejection (E2E 0) is in no panel."""
    ran = Timeline("ran", 0.0, 4)
    ran.record_scheduled(0.0)
    ran.record_tokens(1.0)
    ran.record_tokens(2.0)
    ran.record_finished(3.0, FinishReason.LENGTH)
    rejected = Timeline("rejected", 0.5, 4)
    rejected.record_finished(0.5, FinishReason.REJECTED)
    assert cdf.latency_samples([ran, rejected], "tick") == {"ttft": [1.0], "tpot": [1.0], "e2e": [3.0]}
