"""docs/design.md, "Layers and the dependency rules": each layer imports only what it may. Checked
in a fresh interpreter per layer, by inspecting `sys.modules` after the import."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "contbatch.core": (
        "torch",
        "numpy",
        "asyncio",
        "contbatch.loop",
        "contbatch.metrics",
        "contbatch.sim",
        "contbatch.traces",
    ),
    # the one step loop: the standard library and core only
    "contbatch.loop": (
        "torch",
        "numpy",
        "asyncio",
        "contbatch.metrics",
        "contbatch.sim",
        "contbatch.engine",
        "contbatch.server",
        "contbatch.traces",
    ),
    "contbatch.traces": ("torch", "numpy", "asyncio", "contbatch.sim", "contbatch.metrics"),
    # the routing core, shared by the cluster simulator and a real gateway: the standard library only
    "contbatch.routing": (
        "torch",
        "numpy",
        "asyncio",
        "contbatch.core",
        "contbatch.loop",
        "contbatch.metrics",
        "contbatch.sim",
        "contbatch.traces",
        "contbatch.engine",
        "contbatch.server",
        "contbatch.bench",
    ),
    "contbatch.metrics": ("torch", "asyncio", "matplotlib", "contbatch.sim", "contbatch.engine", "contbatch.server"),
    "contbatch.sim": ("torch", "asyncio", "matplotlib", "contbatch.engine", "contbatch.server"),
    "contbatch.plots": ("torch", "asyncio", "matplotlib", "contbatch.sim", "contbatch.engine", "contbatch.server"),
    "contbatch.sweep": ("torch", "asyncio", "contbatch.engine", "contbatch.server"),
    # torch itself loads asyncio (unittest.mock); tests/engine checks the engine's own imports for it
    "contbatch.engine": ("fastapi", "contbatch.sim", "contbatch.server"),
    "contbatch.server": ("torch",),
    "contbatch.bench": ("torch", "contbatch.engine", "contbatch.sim"),
    # the gateway (`app` imports every module of it): the routing core and the server's access and
    # error helpers, never the simulator, the engine or the server's driver
    "contbatch.gateway.app": (
        "torch",
        "numpy",
        "contbatch.engine",
        "contbatch.sim",
        "contbatch.bench",
        "contbatch.metrics",
        "contbatch.traces",
        "contbatch.server.driver",
        "contbatch.server.serving",
        "contbatch.server.backends.sim",
    ),
    # observes a server from the outside and fits the simulator to it: never torch or the engine
    # (only `observe.validate` reuses calibrate's metric list, which loads torch)
    **dict.fromkeys(
        ("contbatch.observe", "contbatch.observe.fit", "contbatch.observe.probe", "contbatch.cli.observe_cmd"),
        ("torch", "fastapi", "matplotlib", "contbatch.engine", "contbatch.server", "contbatch.calibrate"),
    ),
    # joins the engine and the simulator; plots only on request, never the server
    "contbatch.calibrate": ("fastapi", "matplotlib", "contbatch.server"),
}

# what the compiled core adds (contbatch.compiled): mypyc's shared library of the build, named
# `<hash>__mypyc`, and `mypy_extensions`, whose `mypyc_attr` marks the core's extension points
COMPILED_RUNTIME = {"mypy_extensions"}

PROBE = """
import importlib, json, sys
module = importlib.import_module(sys.argv[1])
for name in getattr(module, "__all__", ()):  # names a package imports on first use (contbatch.lazy) too
    getattr(module, name)
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
        and m not in COMPILED_RUNTIME and not m.endswith("__mypyc")
    )  # fmt: skip
    assert not third_party, f"contbatch.core loads third-party modules: {sorted(set(third_party))}"


def test_routing_uses_only_the_standard_library() -> None:
    """A gateway imports the routing core without the simulator and without third-party code."""
    import importlib.util

    if importlib.util.find_spec("contbatch.routing") is None:
        pytest.skip("contbatch.routing is not part of this checkout yet")
    loaded = _modules_after_import("contbatch.routing")
    outside = sorted(
        m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith("_")
        and m not in ("contbatch", "contbatch.compiled") and not m.startswith("contbatch.routing")
    )  # fmt: skip
    assert not outside, f"contbatch.routing loads {outside}"


def test_core_never_reads_a_clock() -> None:
    """The core takes `now` as an argument: none of its modules imports a clock module."""
    import ast
    import pathlib

    import contbatch.core

    clocks = {"time", "datetime"}
    offenders = []
    for path in pathlib.Path(contbatch.core.__file__).parent.rglob("*.py"):
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


# -- one contract: nothing outside core reads core's private names or the scheduler's state ---------
SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "contbatch"
SCHEDULER_STATE = {"memory", "requests"}  # the scheduler's memory layer and request registry


def _private_names_of_core() -> set[str]:
    """Every single-underscore name core defines: module functions and globals, methods, attributes."""
    names: set[str] = set()
    for path in (SRC / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _looks_like_a_scheduler(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "sched" in name or name == "s"


def _violations(path: pathlib.Path, private: set[str], *, root: pathlib.Path = SRC.parent) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("contbatch.core"):
            found += [f"{where}: imports {a.name} from {node.module}" for a in node.names if a.name in private]
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        is_self = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
        if node.attr in private and not is_self:
            found.append(f"{where}: reads core's private {node.attr}")
        if node.attr in SCHEDULER_STATE and _looks_like_a_scheduler(owner):
            found.append(f"{where}: reads the scheduler's {node.attr}")
        if node.attr == "block_table" and isinstance(owner, ast.Attribute) and owner.attr == "kv":
            found.append(f"{where}: reads the KV manager's block tables")
    return found


def test_nothing_outside_core_reads_core_internals() -> None:
    """The step output carries what executors and drivers need (docs/design.md, the step contract):
    outside `contbatch.core`, no module reads a private name of core, the scheduler's memory or
    request registry, or the KV manager's block tables."""
    private = _private_names_of_core()
    offenders = [
        v for path in sorted(SRC.rglob("*.py")) if "core" not in path.relative_to(SRC).parts[:1]
        for v in _violations(path, private)
    ]  # fmt: skip
    assert not offenders, "\n".join(offenders)


def test_the_internals_check_catches_what_it_forbids(tmp_path: pathlib.Path) -> None:
    """The check above is not vacuous: each forbidden shape is found."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from contbatch.core.base import _x\n"
        "scheduler._step_id += 1\n"
        "held = engine.scheduler.memory.kv.block_table('a')\n"
        "live = self.scheduler.requests\n"
        "fine = trace.requests, self._own\n"
    )
    found = _violations(bad, {"_x", "_step_id", "_own"}, root=tmp_path)
    assert len(found) == 5, found
