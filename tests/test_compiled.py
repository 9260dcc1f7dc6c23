"""The compiled core (`contbatch.compiled`): used only while its build matches every source, the
same results as the Python core, and the tests that patch the core's internals run on the latter."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from abc import ABCMeta
from collections.abc import Iterator
from pathlib import Path

import pytest

from contbatch import compiled
from contbatch.compiled import MANIFEST, MODULES, SUFFIX, current_build, source_digest, source_path

PURE = os.environ | {compiled.OPT_OUT: "1"}
ROOT = Path(__file__).resolve().parents[1]
needs_build = pytest.mark.skipif(not compiled.in_use(), reason=f"the core is {compiled.describe()}")


def _fake_build(tmp: Path, **changes: object) -> Path:
    """A build directory whose manifest matches the sources now, with `changes` to the manifest."""
    extensions = {m: m.replace(".", "/") + SUFFIX for m in MODULES} | {"abc__mypyc": "abc__mypyc" + SUFFIX}
    for rel in extensions.values():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(b"")
    manifest = {"suffix": SUFFIX, "sources": {m: source_digest(source_path(m)) for m in MODULES}}
    (tmp / MANIFEST).write_text(json.dumps(manifest | {"extensions": extensions} | changes))
    return tmp


def test_a_build_is_used_only_while_it_matches_every_source(tmp_path: Path) -> None:
    files, why = current_build(str(_fake_build(tmp_path / "ok")))
    assert files is not None and why == "" and set(files) == {*MODULES, "abc__mypyc"}
    edited = {m: source_digest(source_path(m)) for m in MODULES} | {MODULES[3]: "0" * 64}
    cases = {
        "edited": (_fake_build(tmp_path / "edited", sources=edited), f"{MODULES[3]} changed since the build"),
        "fewer": (_fake_build(tmp_path / "fewer", sources={MODULES[0]: "x"}), "another module list"),
        "suffix": (_fake_build(tmp_path / "suffix", suffix=".cpython-39-x.so"), "this interpreter loads"),
        "none": (tmp_path / "none", "not built"),
    }
    missing = _fake_build(tmp_path / "missing")
    (missing / ("abc__mypyc" + SUFFIX)).unlink()
    cases["missing"] = (missing, "is missing")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / MANIFEST).write_text("{not json")
    cases["garbled"] = (tmp_path / "garbled", "not built")
    for name, (directory, reason) in cases.items():
        files, why = current_build(str(directory))
        assert files is None and reason in why, name


def test_no_class_of_the_compiled_modules_is_an_abc() -> None:
    # compiled, a class derived from an ABC gets no `_abc_impl` of its own: isinstance against
    # it reads the ABC's cache, and answered True for a ContinuousScheduler against StaticScheduler
    for module in MODULES:
        classes = [c for c in vars(importlib.import_module(module)).values() if isinstance(c, type)]
        # (a Protocol's metaclass is ABCMeta too, but it is only a type: nothing derives from it)
        ours = [c for c in classes if c.__module__ == module and not getattr(c, "_is_protocol", False)]
        abcs = [c.__qualname__ for c in ours if isinstance(c, ABCMeta)]
        assert not abcs, f"{module}: {abcs} derive from ABC"


def _written_out_inits(tree: ast.Module) -> Iterator[tuple[str, list[ast.AnnAssign], ast.FunctionDef]]:
    """(class name, its dataclass fields, its own `__init__`) of each dataclass in `tree` that
    writes its `__init__` out."""
    for node in tree.body:
        decorators = [ast.unparse(d) for d in node.decorator_list] if isinstance(node, ast.ClassDef) else []
        if any(d.startswith("dataclass") for d in decorators):
            assert isinstance(node, ast.ClassDef)
            fields = [item for item in node.body if isinstance(item, ast.AnnAssign)]
            inits = [item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"]
            if inits:
                yield node.name, fields, inits[0]


def _init_field(field: ast.AnnAssign) -> tuple[str, str | None] | None:
    """(name, the `__init__` default it must have: None for none) of a field `__init__` takes;
    None for a field it does not (``init=False``). A field with a default factory defaults to None."""
    assert isinstance(field.target, ast.Name)
    value = field.value
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
        keywords = {k.arg: ast.unparse(k.value) for k in value.keywords}
        if keywords.get("init") == "False":
            return None
        return field.target.id, keywords.get("default", "None")
    return field.target.id, None if value is None else ast.unparse(value)


def _names(tree: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def _assignment(statement: ast.stmt) -> tuple[str, ast.AST]:
    """(attribute, value) of ``self.x = value`` or ``object.__setattr__(self, "x", value)``."""
    if isinstance(statement, ast.Assign) and isinstance(target := statement.targets[0], ast.Attribute):
        return target.attr, statement.value
    call = statement.value if isinstance(statement, ast.Expr) else None
    if isinstance(call, ast.Call) and ast.unparse(call.func) == "object.__setattr__":
        _, name, value = call.args
        return ast.literal_eval(name), value
    return "", statement


def test_a_written_out_dataclass_init_takes_and_sets_every_field() -> None:
    # compiled, a dataclass's generated __init__ runs as Python; the hot ones write theirs out, and
    # must stay what the generated one would be (same parameters, defaults and attributes set)
    checked = []
    for module in MODULES:
        tree = ast.parse(Path(source_path(module)).read_text())
        for name, fields, init in _written_out_inits(tree):
            expected = [f for f in map(_init_field, fields) if f is not None]
            params = init.args.args[1:]
            defaults = [None] * (len(params) - len(init.args.defaults)) + [ast.unparse(d) for d in init.args.defaults]
            assert [(p.arg, d) for p, d in zip(params, defaults, strict=True)] == expected, f"{module}.{name}"
            assigned = dict(map(_assignment, init.body))
            unset = [f for f, _ in expected if f not in _names(assigned.get(f, ast.Pass()))]
            assert not unset, f"{module}.{name} does not set {unset} from the parameter of that name"
            checked.append(name)
    assert {"SchedulerOutput", "Timeline", "Grant"} <= set(checked)


def _loaded_from(env: dict[str, str]) -> str:
    code = "import contbatch.core.scheduler as m; print(m.__file__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


@needs_build
def test_the_build_is_loaded_unless_opted_out() -> None:
    assert _loaded_from(dict(os.environ)).strip().endswith(SUFFIX)
    assert _loaded_from(PURE).strip().endswith("scheduler.py")


# each run's whole result, printed: timelines to the float, totals, the scheduler's statistics
_RUNS = """
import dataclasses, json
from contbatch.core import ContinuousScheduler, SchedulerConfig, StaticScheduler, seed_config
from contbatch.core.config import KVConfig, LifecycleConfig
from contbatch.sim import AffineCost, UnitCost, parse_cost, simulate
from contbatch.traces import load_trace
from contbatch.traces.scenarios import cancel_storm, multi_tenant
from contbatch.traces.synthetic import generate, poisson, uniform

kv_trace = generate("kv", 300, poisson(4.0), uniform(20, 400), uniform(10, 300), seed=3)
kv = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=48, kv=KVConfig(num_blocks=120))
runs = [
    (load_trace("seed"), ContinuousScheduler(seed_config()), UnitCost(8), {}),
    (kv_trace, ContinuousScheduler(kv), parse_cost("roofline:llama-2-7b@a100"), {}),
    (kv_trace, ContinuousScheduler(kv), AffineCost(), {"skip_ahead": False}),
    (kv_trace, ContinuousScheduler(dataclasses.replace(kv, kv=KVConfig(num_blocks=120, preemption="swap",
        num_host_blocks=200))), AffineCost(), {}),
    (kv_trace, StaticScheduler(kv), AffineCost(), {}),
    (multi_tenant(), ContinuousScheduler(SchedulerConfig(queue_order="fair", kv=KVConfig(num_blocks=2000))),
        AffineCost(), {}),
    (cancel_storm(), ContinuousScheduler(SchedulerConfig(lifecycle=LifecycleConfig(request_timeout=30.0),
        kv=KVConfig(num_blocks=3000))), AffineCost(), {}),
]
for trace, scheduler, cost, options in runs:
    r = simulate(trace, scheduler, cost, **options)
    print(repr(r.timelines), r.num_steps, r.busy_time, r.kv_usage_mean, json.dumps(r.scheduler_stats, sort_keys=True))
"""


@needs_build
def test_the_python_core_gives_the_compiled_core_s_results_to_the_bit() -> None:
    def results(env: dict[str, str]) -> list[str]:
        command = [sys.executable, "-c", _RUNS]
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.splitlines()

    ours, theirs = results(dict(os.environ)), results(PURE)
    assert len(ours) == 7 and all(ours)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"run {i} differs"


@needs_build
def test_the_tests_that_patch_the_core_pass_on_the_python_core(interpreted_tests: list[str]) -> None:
    if not interpreted_tests:
        pytest.skip("no test marked interpreted was collected in this session")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *interpreted_tests]
    done = subprocess.run(command, check=False, env=PURE, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and f"{len(interpreted_tests)} passed" in done.stdout, done.stdout[-3000:]


def test_without_mypyc_or_a_compiler_the_build_says_so_and_builds_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from contbatch import compiled_build

    def fail_build(build_dir: str = "") -> None:
        raise AssertionError("nothing may be built")

    monkeypatch.setattr(compiled_build, "build", fail_build)
    monkeypatch.setenv("CC", "no-such-cc")
    assert compiled_build.main(["--force"]) == 0
    assert "no C compiler (no-such-cc not found); the Python core runs" in capsys.readouterr().out
    monkeypatch.setattr(compiled_build.importlib.util, "find_spec", lambda name: None)
    assert compiled_build.main(["--force"]) == 0
    assert "mypyc is not installed" in capsys.readouterr().out
