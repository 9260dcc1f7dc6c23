"""Builds the compiled core that `contbatch.compiled` loads.

`python -m contbatch.compiled_build` compiles `MODULES` with mypyc (shipped with mypy, a dev
dependency) unless the build in `_compiled/` is current; `--force` rebuilds anyway; `--status`
only says what is in use. Where mypyc, setuptools or a C compiler is missing it says so and builds nothing
(exit 0: the Python core runs, with the same results). The build compiles a copy of the package (an edit made meanwhile
cannot enter it unrecorded), without debug symbols, and replaces `_compiled/` only
when every module compiled: a failed build leaves the previous one, which the sources' digests
then keep unused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from contbatch.compiled import (
    BUILD_DIR,
    MANIFEST,
    MODULES,
    PACKAGE_DIR,
    SUFFIX,
    current_build,
    describe,
    module_file,
    source_digest,
)

SETUP = """
from mypyc.build import mypycify
from setuptools import setup

setup(name="contbatch-compiled", ext_modules=mypycify({files!r}, opt_level="3", debug_level="0"))
"""


def missing_tool() -> str:
    """What the build needs and this machine lacks, in words ("" when nothing is missing)."""
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (it comes with mypy: pip install mypy)"
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed (mypyc builds with it: pip install setuptools)"
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[:1]
    if not compiler or shutil.which(compiler[0]) is None:
        return f"no C compiler ({' '.join(compiler) or 'CC'} not found)"
    return ""


def build(build_dir: str = BUILD_DIR) -> None:
    """Compile `MODULES` from a copy of the package; replace `build_dir` only when all succeeded."""
    with tempfile.TemporaryDirectory(prefix="contbatch-mypyc-") as work:
        ignore = shutil.ignore_patterns("__pycache__", "_compiled", "_compiled.new", "*.so")
        shutil.copytree(PACKAGE_DIR, os.path.join(work, "contbatch"), ignore=ignore)
        files = [module_file(m, ".py") for m in MODULES]
        with open(os.path.join(work, "setup.py"), "w", encoding="utf-8") as handle:
            handle.write(SETUP.format(files=files))
        command = [sys.executable, "setup.py", "build_ext", "--inplace"]
        done = subprocess.run(command, cwd=work, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"mypyc failed, nothing replaced:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
        shared = [name for name in os.listdir(work) if name.endswith("__mypyc" + SUFFIX)]
        extensions = {name.removesuffix(SUFFIX): name for name in shared}
        extensions |= {m: module_file(m, SUFFIX) for m in MODULES}
        sources = {m: source_digest(os.path.join(work, path)) for m, path in zip(MODULES, files, strict=True)}
        staging = build_dir + ".new"
        shutil.rmtree(staging, ignore_errors=True)
        for rel in extensions.values():
            os.makedirs(os.path.join(staging, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(os.path.join(work, rel), os.path.join(staging, rel))
        manifest = {"suffix": SUFFIX, "sources": sources, "extensions": extensions}
        with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1, sort_keys=True)
        shutil.rmtree(build_dir, ignore_errors=True)
        os.replace(staging, build_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m contbatch.compiled_build", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--force", action="store_true", help="rebuild even when the build is current")
    mode.add_argument("--status", action="store_true", help="only say whether the compiled core is in use")
    args = parser.parse_args(argv)
    if args.status:
        print(describe())
        return 0
    if not args.force and current_build()[0] is not None:
        print(f"the compiled core in {BUILD_DIR} is current")
    elif missing := missing_tool():
        print(f"not compiling the core: {missing}; the Python core runs")
    else:
        build()
        print(f"compiled {len(MODULES)} modules into {BUILD_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
