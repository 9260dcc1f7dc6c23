"""The `vllm` preset takes vLLM V1's scheduler decisions, step for step.

`benchmarks/vllm_decisions.py` drives contbatch and vLLM's own `Scheduler` on the vLLM anchor
driver's workloads. Here, contbatch's per-step decisions (scheduled request ids with their token
counts, preempted ids) are checked against vLLM's, recorded by that script into
`data/vllm_decisions_small.json` (150 requests; every variant: all at once or Poisson arrivals,
ample, 3,000 or 1,500 blocks, prefix caching off and on), so the check runs without vLLM; and,
when the vLLM anchor venv is installed, against vLLM live.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "data" / "vllm_decisions_small.json"
VLLM_PYTHON = Path(
    os.environ.get("CONTBATCH_VLLM_PYTHON", "~/.cache/contbatch-anchors/vllm-venv/bin/python")
).expanduser()


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_decisions", ROOT / "benchmarks" / "vllm_decisions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("vllm_decisions", module)
    spec.loader.exec_module(module)
    return module


BENCH = load_benchmark()
RECORDED: dict[str, Any] = json.loads(FIXTURE.read_text())


def workload_args(**workload: Any) -> Any:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in workload.items()]
    return BENCH.parser().parse_args(flags)


def test_the_fixture_covers_every_variant() -> None:
    assert set(RECORDED["variants"]) == set(BENCH.VARIANTS)
    assert any(v["totals"]["preemptions"] for v in RECORDED["variants"].values())  # not a trivial workload


@pytest.mark.parametrize("variant", sorted(BENCH.VARIANTS))
def test_same_decisions_as_recorded_vllm(variant: str) -> None:
    args = BENCH.variant_args(workload_args(**RECORDED["args"]), variant)
    ours = BENCH.run_contbatch(args)
    theirs = RECORDED["variants"][variant]
    assert BENCH.totals(ours) == theirs["totals"]
    digests = BENCH.step_digests(ours)
    first = next((i for i, (a, b) in enumerate(zip(digests, theirs["digests"], strict=False)) if a != b), None)
    assert first is None, f"{variant}: first different decision at step {first}: {ours['steps'][first]}"
    assert len(digests) == len(theirs["digests"])


def test_a_changed_decision_is_caught() -> None:
    """The digests see one token moved between two requests of one step."""
    args = BENCH.variant_args(workload_args(**RECORDED["args"]), "all-1500")
    ours = BENCH.run_contbatch(args)
    digests = BENCH.step_digests(ours)
    (a, n_a), (b, n_b) = ours["steps"][0][:2]
    ours["steps"][0][:2] = [[a, n_a - 1], [b, n_b + 1]]
    assert BENCH.totals(ours) == RECORDED["variants"]["all-1500"]["totals"]
    assert BENCH.step_digests(ours)[0] != digests[0]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="the vLLM anchor venv is not installed")
@pytest.mark.parametrize("variant", ["poisson-1500", "all-1500-prefix"])
def test_same_decisions_as_live_vllm(variant: str) -> None:
    args = BENCH.variant_args(workload_args(num_requests=80, seed=7), variant)
    theirs = BENCH.record_vllm(str(VLLM_PYTHON), args)
    ours = BENCH.run_contbatch(args)
    assert BENCH.first_divergence(ours, theirs) is None
    assert BENCH.totals(ours) == BENCH.totals(theirs)
