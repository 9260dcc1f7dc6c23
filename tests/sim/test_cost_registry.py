"""The `COST_MODELS` registry: every kind parses an example to a model in the unit it declares, the
`--cost` help lists every kind, and one registry entry adds a cost model end to end."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from contbatch.cli.options import add_run_flags
from contbatch.core.outputs import SchedulerOutput
from contbatch.sim.cost import COST_MODELS, CostKind, CostSpecError, cost_help, parse_cost

TABLE = Path(__file__).with_name("cost_table_example.csv")
PROFILE = {
    "format": "contbatch-profile",
    "version": 1,
    "cost": {
        "model": "affine",
        "loop_scale": 1.0,
        "loop_base_ms": 0.5,
        "loop_request_ms": 0.1,
        "swap_ms_per_block": 0.3,
        "affine": {"base_ms": 4.0, "prefill_ms": 0.25, "decode_ms": 0.5, "context_ms": 0.01},
    },
}


def examples(tmp_path: Path) -> dict[str, str]:
    """One good spec per registered kind: a kind added without an example here fails the test below."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    return {
        "unit": "unit:4",
        "affine": "affine:base_ms=8",
        "roofline": "roofline:mixtral-8x7b@h100x2,ep=2",
        "table": f"table:{TABLE}",
        "profile": f"profile:{profile},speed=2",
    }


def test_every_kind_parses_its_example_in_the_unit_it_declares(tmp_path: Path) -> None:
    specs = examples(tmp_path)
    assert set(specs) == set(COST_MODELS)
    step = SchedulerOutput(
        step_id=0,
        chunks=(),
        num_batched_tokens=9,
        num_prefill_tokens=8,
        num_decode_tokens=1,
        num_context_tokens=20,
        num_requests=2,
    )
    for name, kind in COST_MODELS.items():
        assert kind.usage.startswith(name) and kind.time_unit in ("tick", "s")
        assert kind.help and "\n" not in kind.help
        cost = parse_cost(specs[name])
        assert cost.time_unit == kind.time_unit, name
        assert cost.step_time(step) > 0


def test_the_cost_flag_help_lists_every_kind() -> None:
    parser = argparse.ArgumentParser(prog="contbatch simulate", formatter_class=argparse.RawTextHelpFormatter)
    add_run_flags(parser)
    text = " ".join(parser.format_help().split())
    for kind in COST_MODELS.values():
        assert kind.usage in text and " ".join(kind.help.split()) in text
    assert "default unit:8" in text


def test_help_by_time_unit() -> None:
    assert cost_help("tick").startswith("unit[:C] (ticks: ")
    seconds = cost_help("s")
    assert "unit[:C]" not in seconds and all(n in seconds for n in ("affine", "roofline", "table", "profile"))
    assert cost_help() == f"{cost_help('tick')}; {seconds}"


@dataclass(frozen=True, slots=True)
class ConstantCost:
    """A toy cost model for the recipe in docs/extending.md: every step takes the same time."""

    seconds: float

    @property
    def time_unit(self) -> str:
        return "s"

    def step_time(self, out: SchedulerOutput) -> float:
        return self.seconds


def parse_constant(args: str) -> ConstantCost:
    try:
        return ConstantCost(float(args))
    except ValueError:
        raise CostSpecError(f"constant cost: expected constant:SECONDS, got {args!r}") from None


def test_one_registry_entry_adds_a_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    kind = CostKind("constant:SECONDS", "s", "every step takes SECONDS", parse_constant)
    monkeypatch.setitem(COST_MODELS, "constant", kind)
    assert parse_cost("constant:0.25") == ConstantCost(0.25)
    assert "constant:SECONDS (seconds: every step takes SECONDS)" in cost_help()
    with pytest.raises(CostSpecError, match="constant:SECONDS"):
        parse_cost("nope")
