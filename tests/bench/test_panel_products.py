"""benchmarks/panel_products.py: the kernels of this checkout against HEAD's, compiled alike, on
one of the demo model's products: the same bits on both sides (the script's own check), every
time measured, the table and the JSON written."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "panel_products.py"


def _head() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


@pytest.mark.skipif(shutil.which("cc") is None or _head() is None, reason="needs a C compiler and a git checkout")
def test_both_sides_give_the_same_bits_and_every_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("panel_products", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "products.json"
    argv = ["--baseline", "HEAD", "--rows", "1", "33", "--shapes", "o", "--reps", "1", "--weight-mib", "1"]
    assert module.main([*argv, "--threads", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["builds"][0] == "native" and set(report["builds"]) <= {"native", "avx2"}
    rows = report["results"]
    assert [(r["build"], r["rows"]) for r in rows] == [(b, n) for b in report["builds"] for n in (1, 33)]
    for row in rows:
        assert row["same_bits"] and row["shape"] == "o" and row["copies"] == 2  # (1 MiB of 384 x 384 floats)
        assert all(t > 0 for t in row["ms"].values()) and set(row["ms"]) == {"baseline", "current", "torch"}
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == module.HEADER and "BITS DIFFER" not in printed
