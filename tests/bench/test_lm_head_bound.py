"""benchmarks/lm_head_bound.py on the demo model's real hidden states: the error bound of a
bfloat16 LM head holds (no logit moves by more than it), and float32's argmax is always among
the candidates it leaves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_head_bound.py"


def test_the_bound_holds_and_keeps_float32s_argmax(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("lm_head_bound", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "bound.json"
    assert module.main(["--requests", "4", "--tokens", "4", "--json-out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"w bf16, h f32", "w bf16, h bf16"}
    for row in variants.values():
        assert row["rows"] == 16
        assert 0 < row["error_over_bound_max"] < 1
        assert row["argmax_among_candidates_is_float32s"]
        assert 1 <= row["candidates_median"] <= row["candidates_max"] < 32000
