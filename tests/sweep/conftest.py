"""Shared builders for sweep tests: a small trace file and sweep files written next to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from contbatch.traces import write_jsonl
from contbatch.traces.synthetic import generate, poisson, uniform

WriteSweep = Callable[[str], Path]


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    """12 requests in seconds, small enough that a grid point takes milliseconds."""
    path = tmp_path / "small.jsonl"
    write_jsonl(generate("small", 12, poisson(10), uniform(32, 160), uniform(8, 48), seed=7), path)
    return path


@pytest.fixture
def write_sweep(tmp_path: Path, small_trace: Path) -> WriteSweep:
    """Write YAML text to tmp_path/sweep.yaml (next to small.jsonl) and return its path."""

    def write(text: str) -> Path:
        path = tmp_path / "sweep.yaml"
        path.write_text(text)
        return path

    return write
