"""docs/design.md, "Layers and the dependency rules", for the server and the bench: what each
imports (in a fresh interpreter, by `sys.modules`) and what their sources name (by AST)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import contbatch

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""
SRC = pathlib.Path(contbatch.__file__).parent


def loaded_after(*modules: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(proc.stdout))


def hits(loaded: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded for f in forbidden if m == f or m.startswith(f + "."))


def test_the_server_never_imports_torch_the_engine_or_the_bench() -> None:
    loaded = loaded_after("contbatch.server.app", "contbatch.server.client", "contbatch.server.backends")
    assert not hits(loaded, ("torch", "contbatch.engine", "contbatch.bench", "contbatch.sim"))


def test_the_bench_never_imports_the_scheduler_side() -> None:
    loaded = loaded_after("contbatch.bench.runner", "contbatch.bench.report", "contbatch.bench.workload")
    assert not hits(loaded, ("torch", "contbatch.engine", "contbatch.sim", "contbatch.server", "fastapi", "uvicorn"))


def imported_names(package: str) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for path in (SRC / package).rglob("*.py"):
        found = names.setdefault(str(path.relative_to(SRC)), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
    return names


@pytest.mark.parametrize("package", ["server", "bench"])
def test_sources_name_only_what_their_layer_may(package: str) -> None:
    for path, names in imported_names(package).items():
        assert not any(n == "torch" or n.startswith("torch.") for n in names), path
        assert not any(n.startswith("contbatch.engine") for n in names), path  # engine: importlib, lazily
        if package == "bench":
            core = {n for n in names if n.startswith("contbatch.core")}
            assert core <= {"contbatch.core.timeline", "contbatch.core.status"}, (path, core)
            assert not any(n.startswith(("contbatch.sim", "contbatch.server")) for n in names), path
        elif "backends" not in path:  # the sim backend (and its registry) wrap the simulator's cost models
            assert not any(n.startswith("contbatch.sim") for n in names), path
