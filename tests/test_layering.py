"""DESIGN.md section 1: each layer imports only what it may. Checked in a fresh interpreter per
layer, by inspecting `sys.modules` after the import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "contbatch.core": ("torch", "numpy", "asyncio", "contbatch.metrics", "contbatch.sim", "contbatch.traces"),
    "contbatch.traces": ("torch", "numpy", "asyncio", "contbatch.sim", "contbatch.metrics"),
    "contbatch.metrics": ("torch", "asyncio", "matplotlib", "contbatch.sim", "contbatch.engine", "contbatch.server"),
    "contbatch.sim": ("torch", "asyncio", "matplotlib", "contbatch.engine", "contbatch.server"),
    "contbatch.plots": ("torch", "asyncio", "matplotlib", "contbatch.sim", "contbatch.engine", "contbatch.server"),
    "contbatch.sweep": ("torch", "asyncio", "contbatch.engine", "contbatch.server"),
    # torch itself loads asyncio (unittest.mock); tests/engine checks the engine's own imports for it
    "contbatch.engine": ("fastapi", "contbatch.sim", "contbatch.server"),
    "contbatch.server": ("torch",),
    "contbatch.bench": ("torch", "contbatch.engine", "contbatch.sim"),
    # joins the engine and the simulator; plots only on request, never the server
    "contbatch.calibrate": ("fastapi", "matplotlib", "contbatch.server"),
}

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after_import(package: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, package], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(proc.stdout))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not part of this checkout yet")
    loaded = _modules_after_import(package)
    bad = sorted(m for m in loaded for f in FORBIDDEN[package] if m == f or m.startswith(f + "."))
    assert not bad, f"importing {package} loads {bad}"


def test_core_uses_only_the_standard_library() -> None:
    loaded = _modules_after_import("contbatch.core")
    third_party = sorted(
        m.split(".")[0]
        for m in loaded
        if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith("contbatch") and not m.startswith("_")
    )
    assert not third_party, f"contbatch.core loads third-party modules: {sorted(set(third_party))}"


def test_core_never_reads_a_clock() -> None:
    """The core takes `now` as an argument: none of its modules imports a clock module."""
    import ast
    import pathlib

    import contbatch.core

    clocks = {"time", "datetime"}
    offenders = []
    for path in pathlib.Path(contbatch.core.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            if names & clocks:
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"core modules importing a clock: {offenders}"
