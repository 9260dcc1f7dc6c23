"""What a `contbatch` process loads before its command runs (checked in fresh interpreters): the
parser of every command is built without the modules only some commands use, and numpy's
OpenBLAS starts one thread unless the environment says otherwise or the command may run torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PARSER_PROBE = """
import json, sys
from contbatch.cli.main import build_parser
build_parser()
print(json.dumps(sorted(sys.modules)))
"""

# loaded by `bench`, `observe`, `serve`, `route`, the engine's commands and `--plot` alone
_NOT_FOR_THE_PARSER = (
    "asyncio",
    "httpx",
    "torch",
    "fastapi",
    "uvicorn",
    "matplotlib",
    "contbatch.bench",
    "contbatch.engine",
    "contbatch.server",
    "contbatch.gateway",
    "contbatch.calibrate",
    "contbatch.observe.probe",
)


def _run(code: str, *args: str, **env: str) -> str:
    """`code`'s output in a fresh interpreter given `args` (its `sys.argv[1:]`) and `env` over an
    environment without OPENBLAS_NUM_THREADS."""
    environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | env
    done = subprocess.run(
        [sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, timeout=120, env=environ
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_building_the_parser_loads_no_command_s_own_modules() -> None:
    loaded = json.loads(_run(_PARSER_PROBE))
    assert "contbatch.cli.main" in loaded and "contbatch.observe.servers" in loaded  # (the probe ran)
    bad = sorted(m for m in loaded for name in _NOT_FOR_THE_PARSER if m == name or m.startswith(name + "."))
    assert not bad, f"building the CLI parser loads {bad}"


@pytest.mark.parametrize(
    ("command", "given", "expected"),
    [("simulate", None, "1"), ("simulate", "3", "3"), ("serve", None, None), ("run", None, None)],
)
def test_openblas_runs_one_thread_unless_told_or_the_command_runs_torch(
    command: str, given: str | None, expected: str | None
) -> None:
    code = "import os, contbatch.cli.main; print(os.environ.get('OPENBLAS_NUM_THREADS'))"
    env = {} if given is None else {"OPENBLAS_NUM_THREADS": given}
    assert _run(code, command, "--help", **env).strip() == str(expected)


def test_observe_names_resolve_on_first_use_to_their_modules_objects() -> None:
    from contbatch import observe
    from contbatch.observe.fit import FitError
    from contbatch.observe.probe import observe as observe_fn
    from contbatch.observe.servers import SERVER_PRESETS

    assert (observe.FitError, observe.observe, observe.SERVER_PRESETS) == (FitError, observe_fn, SERVER_PRESETS)
    assert set(observe.__all__) <= set(dir(observe)) | set(observe._LAZY)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        observe.nothing  # noqa: B018
