"""The synthetic built-in traces: each loads, is the same in every interpreter, and has its shape."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.traces import Trace, TraceRequest, builtin_trace_names, load_trace, write_jsonl
from contbatch.traces.scenarios import PREFIX_TOKENS, SCENARIOS
from contbatch.traces.synthetic import mean_rate

# sha256 of each built-in's JSONL export. A built-in is a fixed benchmark: if one of these changes,
# every number measured on it changes too, so update a hash only on purpose (and say so).
GOLDEN_SHA256 = {
    "seed-scaled": "4676d270f6da618b15d5f9498dac501d1a14743ad13e180986f94eb0f22fcb27",
    "kv-pressure": "c531e9062f53dee9c0ba6245bbb973f3c2aa8cd6705ddf8d5e16a7db90a64207",
    "long-prompt": "4f3dcc609de560960815aefe7f67fe6f9c3aedd6d2421f50588f0efd401feb7a",
    "multi-tenant": "4d2f8f687a8634d41b17e22d0764d73737a423429d9ccfbc5db3775d1a694e8c",
    "priority-mix": "d2e4641e9d045343227d97327a7af39e8c543a080ccf5e0b7c70881dd080f088",
    "deadlines": "956b459d137122ca00f35e7a743c3e585d9bd06f1328210f1448d6a6da5e3f5f",
    "cancel-storm": "ce09a210aeab1be3c2eaf33d6126fff91a5995c2f4df9c4771ea1e2a09129c04",
    "slow-readers": "9e7c3a84e6e0a542b51ac3edca75bcd10a8c99265d1eb272725d59b3f3ae0313",
    "prefix-share": "f8d018a5bfb1199d850967ba029953f6542f935325dcc7902303f1a5fb5ba50c",
}

_PROBE = """
import hashlib, json, pathlib, sys, tempfile
from contbatch.traces import load_trace, write_jsonl
from contbatch.traces.scenarios import SCENARIOS
hashes = {}
with tempfile.TemporaryDirectory() as folder:
    for name in SCENARIOS:
        path = pathlib.Path(folder) / "export.jsonl"
        write_jsonl(load_trace(name), path)
        hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()
print(json.dumps(hashes))
"""


def _fresh_interpreter_hashes(hash_seed: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, env=env)
    hashes: dict[str, str] = json.loads(result.stdout)
    return hashes


def _export_hash(trace: Trace, tmp_path: Path) -> str:
    path = tmp_path / f"{trace.name}.jsonl"
    write_jsonl(trace, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_scenario_is_a_builtin_after_seed_and_azure() -> None:
    assert builtin_trace_names() == ("seed", "azure-code", *SCENARIOS)
    assert set(GOLDEN_SHA256) == set(SCENARIOS)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_loads_and_describes_itself(name: str) -> None:
    trace = load_trace(name)
    assert (trace.name, trace.time_unit) == (name, "s")
    assert trace.source.startswith(("synthetic (contbatch.traces.synthetic, seed ", "contbatch: "))
    assert "; for " in trace.source  # what it is for
    assert load_trace(name) is trace  # generated once, cached
    assert trace.requests[0].arrival_ts == 0.0


def test_deterministic_across_fresh_interpreters(tmp_path: Path) -> None:
    first, second = _fresh_interpreter_hashes("0"), _fresh_interpreter_hashes("4242")
    here = {name: _export_hash(load_trace(name), tmp_path) for name in SCENARIOS}
    assert first == second == here
    assert here == GOLDEN_SHA256


def _arrival_rate_near(trace: Trace, rate: float) -> None:
    assert mean_rate(trace) == pytest.approx(rate, rel=0.15)


def _within(requests: list[TraceRequest] | Trace, prompts: tuple[int, int], outputs: tuple[int, int]) -> None:
    assert all(prompts[0] <= r.num_prompt_tokens <= prompts[1] for r in requests)
    assert all(outputs[0] <= r.num_output_tokens <= outputs[1] for r in requests)


def test_kv_pressure() -> None:
    trace = load_trace("kv-pressure")
    assert len(trace) == 300
    _arrival_rate_near(trace, 5.0)
    _within(trace, (256, 2048), (64, 1024))
    assert {r.max_output_tokens for r in trace} == {2048}
    assert {r.output_limit for r in trace} == {2048}
    assert sum(r.output_limit for r in trace) > 3 * sum(r.num_output_tokens for r in trace)


def test_long_prompt() -> None:
    trace = load_trace("long-prompt")
    long = [r for r in trace if r.request_id == "long"]
    assert long == [TraceRequest("long", 20.0, 8000, 16)]
    short = [r for r in trace if r.request_id != "long"]
    assert all(r.request_id.startswith("short-") and r.arrival_ts < 60.0 for r in short)
    assert 200 <= len(short) <= 280  # Poisson 4 req/s for 60 s: 240 on average
    _within(short, (64, 256), (64, 128))


def test_multi_tenant() -> None:
    trace = load_trace("multi-tenant")
    by_tenant: dict[str | None, list[TraceRequest]] = collections.defaultdict(list)
    for request in trace:
        by_tenant[request.tenant].append(request)
    assert set(by_tenant) == {"heavy", "light-1", "light-2", "light-3", "light-4"}
    assert all(r.arrival_ts < 60.0 and r.request_id.startswith(f"{r.tenant}-") for r in trace)
    assert 300 <= len(by_tenant["heavy"]) <= 420  # 6 req/s for 60 s: 360 on average
    _within(by_tenant["heavy"], (1024, 2048), (128, 256))
    for k in range(1, 5):
        light = by_tenant[f"light-{k}"]
        assert 15 <= len(light) <= 50  # 0.5 req/s for 60 s: 30 on average
        _within(light, (64, 256), (32, 64))


def test_priority_mix() -> None:
    trace = load_trace("priority-mix")
    assert len(trace) == 400
    _arrival_rate_near(trace, 16.0)
    _within(trace, (256, 1024), (64, 256))
    priorities = [r.priority for r in trace]
    assert collections.Counter(priorities) == {0: 80, 1: 120, 2: 200}
    for half in (priorities[:200], priorities[200:]):  # shuffled, not in blocks
        assert collections.Counter(half)[0] / 200 == pytest.approx(0.2, abs=0.07)


def test_deadlines() -> None:
    trace = load_trace("deadlines")
    assert len(trace) == 300
    _arrival_rate_near(trace, 12.0)
    _within(trace, (128, 1024), (32, 256))
    slack = [r.deadline_ts - r.arrival_ts for r in trace if r.deadline_ts is not None]
    assert len(slack) == 300
    assert all(2.0 <= s <= 20.0 for s in slack)
    assert statistics.fmean(slack) == pytest.approx(11.0, rel=0.1)  # uniform 2-20


def test_cancel_storm() -> None:
    trace = load_trace("cancel-storm")
    assert len(trace) == 300
    _arrival_rate_near(trace, 5.0)
    _within(trace, (128, 1024), (128, 512))
    after = [r.cancel_ts - r.arrival_ts for r in trace if r.cancel_ts is not None]
    assert len(after) == 150
    assert all(0.5 <= a <= 8.0 for a in after)
    first_half = sum(r.cancel_ts is not None for r in trace.requests[:150])
    assert 55 <= first_half <= 95  # chosen at random, not the first or last 150


def test_slow_readers() -> None:
    trace = load_trace("slow-readers")
    assert len(trace) == 200
    _arrival_rate_near(trace, 4.0)
    _within(trace, (128, 512), (128, 512))
    rates = [r.read_rate for r in trace if r.read_rate is not None]
    assert len(rates) == 60
    assert all(5.0 <= rate <= 20.0 for rate in rates)


def test_prefix_share() -> None:
    trace = load_trace("prefix-share")
    assert len(trace) == 300
    _arrival_rate_near(trace, 5.0)
    prefixes: dict[str | None, set[int]] = collections.defaultdict(set)
    for request in trace:
        prefixes[request.prefix_group].add(request.prefix_tokens)
        assert 32 <= request.num_prompt_tokens - request.prefix_tokens <= 256
        assert 32 <= request.num_output_tokens <= 256
    assert prefixes == {f"sys-{g}": {tokens} for g, tokens in enumerate(PREFIX_TOKENS)}
    assert PREFIX_TOKENS == (512, 1024, 1536, 2048)
    counts = collections.Counter(r.prefix_group for r in trace)
    assert min(counts.values()) >= 50  # 75 each on average
