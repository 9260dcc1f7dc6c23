"""Dependency rule: contbatch.metrics imports core types and numpy, never sim/engine/server."""

from __future__ import annotations

import json
import subprocess
import sys


def test_metrics_imports_only_allowed_packages() -> None:
    code = "import json, sys; import contbatch.metrics; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    modules = json.loads(out)
    for banned in ("contbatch.sim", "contbatch.engine", "contbatch.server", "contbatch.bench"):
        assert not any(m == banned or m.startswith(banned + ".") for m in modules), banned
    for heavy in ("matplotlib", "torch"):
        assert heavy not in modules
