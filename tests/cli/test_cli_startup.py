"""What a `contbatch` process loads before its command runs (checked in fresh interpreters): the
parser of every command is built without the modules only some commands use, `simulate` loads
no other command's modules (its parser alone is built) and no trace importer, table or plot it
is not asked for, and numpy's OpenBLAS starts one thread unless the environment says otherwise
or the command may run torch."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.cli.main import build_parser, main

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
    "aiohttp",
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


_SIMULATE_PROBE = """
import json, sys
from contbatch.cli.main import main
main(sys.argv[1:])
print(json.dumps(sorted(sys.modules)))
"""

# a `simulate` of a JSONL trace needs none of these (other commands', or flags' it was not given)
_NOT_FOR_SIMULATE = (
    *_NOT_FOR_THE_PARSER,
    "contbatch.cli.bench_cmd",
    "contbatch.cli.calibrate_cmd",
    "contbatch.cli.capacity_cmd",
    "contbatch.cli.capacity_fleet",
    "contbatch.cli.engine_cmd",
    "contbatch.cli.observe_cmd",
    "contbatch.cli.route_cmd",
    "contbatch.cli.serve_cmd",
    "contbatch.cli.sweep_cmd",
    "contbatch.observe",
    "contbatch.routing",
    "contbatch.plots",
    "contbatch.sim.capacity",
    "contbatch.sim.cluster",
    "contbatch.sim.cluster_config",
    "contbatch.sim.fleet_plan",
    "contbatch.metrics.groups",
    "contbatch.metrics.export",
    "contbatch.traces.azure",
    "contbatch.traces.burstgpt",
    "contbatch.traces.canonical_csv",
    "contbatch.traces.vidur",
    "difflib",  # (the JSONL loader's hint for an unknown key only)
    "importlib.resources",
)


def test_simulate_loads_no_other_command_s_modules(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "arrival": 0, "prompt_tokens": 4, "output_tokens": 3}\n')
    out = _run(_SIMULATE_PROBE, "simulate", "--trace", str(trace), "--cost", "roofline:llama-2-7b@a100")
    loaded = json.loads(out.strip().splitlines()[-1])
    assert "contbatch.sim.loop" in loaded and "contbatch.metrics.compare" in loaded  # (the run and its table)
    bad = sorted(m for m in loaded for name in _NOT_FOR_SIMULATE if m == name or m.startswith(name + "."))
    assert not bad, f"contbatch simulate loads {bad}"


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--trace", "seed", "--set", "max_num_seqs=4", "--json"],
        ["compare", "--trace", "seed", "--policy", "fcfs,fair", "--by", "none"],
        ["capacity", "--slo", "ttft=1", "--rate", "2", "--kind", "2:unit:8"],
        ["serve", "--backend", "sim"],
        ["fit", "--observed", "o.jsonl", "--server", "vllm", "--out", "p.json"],
        ["run", "--trace", "seed"],
    ],
)
def test_a_command_s_own_parser_parses_as_the_full_parser(argv: list[str]) -> None:
    whole, own = build_parser().parse_args(argv), build_parser(argv[0]).parse_args(argv)
    assert isinstance(own, argparse.Namespace) and vars(own) == vars(whole)


def test_a_simulation_command_leaves_the_collector_as_it_found_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert main(["simulate", "--trace", "seed"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        assert main(["compare", "--trace", "seed"]) == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert "continuous" in capsys.readouterr().out
