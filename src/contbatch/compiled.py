"""The scheduler core and the hot loops, compiled with mypyc where a current build exists.

`python -m contbatch.compiled_build` compiles `MODULES`, unchanged, into `_compiled/` next to this
file (`make demo` and `make test` do it) and says which is in use.
`install()`, run by `contbatch/__init__.py` before any of them can be imported, puts a finder first
on `sys.meta_path` that loads the compiled ones.

Invariants:
- The Python sources are the reference and the fallback. The build is used only when its manifest
  lists exactly `MODULES`, with the sha256 of each source equal to that file's now, built for this
  interpreter's extension suffix. One edit to one of them turns the whole build off until it is
  rebuilt: never a stale module, and never a compiled module calling a Python one it was built with.
- `CONTBATCH_PURE_PYTHON=1` turns the build off; so does its absence (no compiler, a wheel install).
- Compiled and Python modules give the same results (tests/test_compiled.py runs both).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader, ModuleSpec
from importlib.util import spec_from_file_location

MODULES = (
    "contbatch.core.admission",
    "contbatch.core.base",
    "contbatch.core.budget",
    "contbatch.core.fastforward",
    "contbatch.core.kv.manager",
    "contbatch.core.kv.pool",
    "contbatch.core.lifecycle",
    "contbatch.core.memory",
    "contbatch.core.outputs",
    "contbatch.core.plan",
    "contbatch.core.queue",
    "contbatch.core.request",
    "contbatch.core.scheduler",
    "contbatch.core.static",
    "contbatch.core.stats",
    "contbatch.core.status",
    "contbatch.core.step",
    "contbatch.core.timeline",
    "contbatch.core.victims",
    "contbatch.loop.clock",
    "contbatch.loop.core",
    "contbatch.loop.observe",
    "contbatch.sim.costs.roofline",
    "contbatch.sim.decode_run",
    "contbatch.sim.executor",
    "contbatch.sim.loop",
    "contbatch.sim.skip_ahead",
)
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.path.join(PACKAGE_DIR, "_compiled")
MANIFEST = "manifest.json"
OPT_OUT = "CONTBATCH_PURE_PYTHON"
SUFFIX = EXTENSION_SUFFIXES[0]


def module_file(module: str, suffix: str) -> str:
    """`module`'s file with `suffix` (".py", `SUFFIX`), relative to the directory above `contbatch`."""
    return os.path.join(*module.split(".")) + suffix


def source_path(module: str) -> str:
    """The `.py` file of `module`, a name under `contbatch`."""
    return os.path.join(os.path.dirname(PACKAGE_DIR), module_file(module, ".py"))


def source_digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def opted_out() -> bool:
    return os.environ.get(OPT_OUT, "") not in ("", "0")


def current_build(build_dir: str = BUILD_DIR) -> tuple[dict[str, str] | None, str]:
    """(module name -> extension file, "") for a build that matches the sources now, else
    (None, why not). The names include mypyc's shared library, which every shim imports."""
    try:
        with open(os.path.join(build_dir, MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return None, f"not built: python -m contbatch.compiled_build writes {build_dir}"
    if manifest.get("suffix") != SUFFIX:
        return None, f"built for {manifest.get('suffix')}, this interpreter loads {SUFFIX}: rebuild"
    sources: dict[str, str] = manifest.get("sources", {})
    if sorted(sources) != sorted(MODULES):
        return None, "built from another module list: rebuild"
    stale = [m for m in MODULES if source_digest(source_path(m)) != sources[m]]
    if stale:
        return None, f"{', '.join(stale)} changed since the build: rebuild"
    files = {name: os.path.join(build_dir, rel) for name, rel in manifest["extensions"].items()}
    missing = [path for path in files.values() if not os.path.exists(path)]
    return (None, f"{missing[0]} is missing: rebuild") if missing else (files, "")


class CompiledFinder:
    """Finds the extension file of each module of one build; every other name falls through (a
    `sys.meta_path` finder; importlib.abc is not imported for its base: it loads importlib.resources)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        return spec_from_file_location(fullname, file, loader=ExtensionFileLoader(fullname, file))


def in_use() -> bool:
    return any(isinstance(f, CompiledFinder) for f in sys.meta_path)


def install() -> None:
    """Load the compiled modules from now on if the build is current and not opted out of."""
    if in_use() or opted_out():
        return
    files, _ = current_build()
    if files is not None:
        sys.meta_path.insert(0, CompiledFinder(files))


def describe() -> str:
    """Which core this process runs, in words (and why not the compiled one)."""
    if in_use():
        return f"compiled with mypyc ({len(MODULES)} modules from {BUILD_DIR})"
    why = f"{OPT_OUT} is set" if opted_out() else current_build()[1] or "built after this process started"
    return f"pure Python ({why})"
