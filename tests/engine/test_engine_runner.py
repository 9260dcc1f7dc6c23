"""ModelRunner step semantics: StepError carries the step's request ids, per-request state is dropped on
finished_ids, seeded sampling does not depend on the batch, and the engine's layering holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contbatch.core.outputs import ScheduledChunk, StepResult, build_output
from contbatch.core.status import FinishReason
from contbatch.engine.attention import head_major
from contbatch.engine.demo import DemoShape, write_random_checkpoint
from contbatch.engine.kv_cache import PagedKVCache, bytes_per_block, num_blocks_for_memory
from contbatch.engine.loader import load_checkpoint
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.engine.sampling import SamplingParams
from contbatch.loop.executor import StepError

SHAPE = DemoShape(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    vocab_size=97,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("m"), SHAPE, seed=2, demo=False)


def _runner(ckpt: Path, num_blocks: int = 16, seed: int = 0) -> ModelRunner:
    spec, weights = load_checkpoint(ckpt)
    return ModelRunner(spec, weights, PagedKVCache(spec, num_blocks, 4), seed=seed)


def test_step_errors_name_the_step_requests(ckpt: Path) -> None:
    runner = _runner(ckpt)
    chunks = [ScheduledChunk("a", 0, 3, True, True), ScheduledChunk("b", 0, 2, True, True)]
    with pytest.raises(StepError) as info:
        runner.execute(build_output(0, chunks), {"a": SequenceState([1, 2, 3], [0])})
    assert info.value.request_ids == ("a", "b") and isinstance(info.value.cause, ValueError)
    assert "'b'" in str(info.value) and info.value.__cause__ is info.value.cause
    bad = {
        "short table": ({"a": SequenceState(list(range(9)), [0, 1])}, [ScheduledChunk("a", 0, 9, True, True)]),
        "beyond tokens": ({"a": SequenceState([1, 2], [0])}, [ScheduledChunk("a", 0, 3, True, True)]),
        "sample mid-sequence": ({"a": SequenceState([1, 2, 3], [0])}, [ScheduledChunk("a", 0, 2, True, True)]),
        "token out of vocab": ({"a": SequenceState([1, 200], [0])}, [ScheduledChunk("a", 0, 2, True, True)]),
        "slot clash": (
            {"a": SequenceState([1, 2], [0]), "b": SequenceState([3, 4], [0])},
            [ScheduledChunk("a", 0, 2, True, True), ScheduledChunk("b", 0, 2, True, True)],
        ),
    }
    for name, (seqs, step) in bad.items():
        with pytest.raises(StepError) as info:
            runner.execute(build_output(1, step), seqs)
        assert set(info.value.request_ids) == {c.request_id for c in step}, name
    with pytest.raises(StepError, match="no swapped-out KV") as info:
        runner.execute(build_output(2, [], swapped_in=(("z", (1,)),)), {})
    assert info.value.request_ids == ("z",)


def test_empty_step_and_finished_ids_drop_state(ckpt: Path) -> None:
    runner = _runner(ckpt)
    assert runner.execute(build_output(0, []), {}) == StepResult()
    params = SamplingParams(temperature=1.0, seed=5)
    seqs = {"a": SequenceState([1, 2, 3], [0], params)}
    runner.execute(build_output(1, [ScheduledChunk("a", 0, 3, True, True)]), seqs)
    runner.execute(build_output(2, [], swapped_out=(("a", (0,)),)), {})
    assert "a" in runner._generators and runner.kv_cache.swapped_ids == ("a",)
    runner.execute(build_output(3, [], finished_ids=("a",)), {})
    assert "a" not in runner._generators and runner.kv_cache.swapped_ids == ()


def test_seeded_request_samples_the_same_whatever_the_batch(ckpt: Path) -> None:
    params = SamplingParams(temperature=1.0, seed=42)

    def run(with_others: bool, runner_seed: int) -> list[int]:
        runner = _runner(ckpt, seed=runner_seed)
        tokens = {"s": [5, 6, 7, 8], "o1": [9, 10], "o2": [11, 12, 13]}
        tables = {"s": [0, 1, 2], "o1": [3, 4], "o2": [5, 6]}
        ids = ["s", "o1", "o2"] if with_others else ["s"]
        chunks = [ScheduledChunk(r, 0, len(tokens[r]), True, True) for r in ids]
        for step in range(6):
            seqs = {r: SequenceState(tokens[r], tables[r], params if r == "s" else SamplingParams()) for r in ids}
            result = runner.execute(build_output(step, chunks), seqs)
            for r, new in result.sampled_token_ids.items():
                tokens[r].extend(new)
            chunks = [ScheduledChunk(r, len(tokens[r]) - 1, 1, False, True) for r in ids]
        return tokens["s"][4:]

    assert run(False, 0) == run(True, 1) == run(True, 2)


def test_kv_memory_sizing(ckpt: Path) -> None:
    spec, _ = load_checkpoint(ckpt)
    per_block = bytes_per_block(spec, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 8 * 4
    assert num_blocks_for_memory(spec, 10 * per_block + 5, 16, torch.float32) == 10
    cache = PagedKVCache.for_memory(spec, 10 * per_block, 16)
    assert cache.num_blocks == 10 and cache.num_bytes == 10 * per_block
    assert cache.layer(1)[0].shape == (10, 16, 2, 8)
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_memory(spec, per_block - 1, 16, torch.float32)


def test_layer_caches_read_head_major_without_a_copy(ckpt: Path) -> None:
    """Each head's slots of a layer's key or value cache are one contiguous run of the storage,
    which paged attention reads in place (the token-order view and the head-major one agree)."""
    spec, _ = load_checkpoint(ckpt)
    cache = PagedKVCache(spec, 6, 4)
    for t in cache.layer(1):
        t.copy_(torch.randn(t.shape))
        heads = head_major(t)
        assert heads.data_ptr() == t.data_ptr() and heads.is_contiguous()
        assert torch.equal(heads.transpose(0, 1), t.reshape(6 * 4, spec.num_kv_heads, spec.head_dim))


def test_swap_moves_the_data(ckpt: Path) -> None:
    spec, _ = load_checkpoint(ckpt)
    cache = PagedKVCache(spec, 6, 4)
    for i in range(spec.num_layers):
        key, value = cache.layer(i)
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
    before = [tuple(t[[4, 1]].clone() for t in cache.layer(i)) for i in range(spec.num_layers)]
    cache.swap_out("r", [4, 1])
    for i in range(spec.num_layers):
        for t in cache.layer(i):
            t.zero_()
    with pytest.raises(ValueError, match="swapped out 2 blocks"):
        cache.swap_in("r", [0])
    cache.swap_in("r", [2, 5])
    for i in range(spec.num_layers):
        for got, want in zip(cache.layer(i), before[i], strict=True):
            assert torch.equal(got[[2, 5]], want)
    with pytest.raises(ValueError, match="no swapped-out KV"):
        cache.swap_in("r", [2, 5])
    with pytest.raises(ValueError, match="out of range"):
        cache.swap_out("q", [6])


def test_engine_layering() -> None:
    """contbatch.engine loads no sim, server, metrics, web framework or transformers; its own modules never
    import asyncio (torch itself loads asyncio through unittest.mock, so sys.modules cannot tell)."""
    import ast

    import contbatch.engine

    probe = (
        "import importlib, json, pkgutil, sys\n"
        "import contbatch.engine as e\n"
        "for m in pkgutil.iter_modules(e.__path__): importlib.import_module('contbatch.engine.' + m.name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(proc.stdout))
    forbidden = ("contbatch.sim", "contbatch.server", "contbatch.metrics", "fastapi", "uvicorn", "transformers")
    bad = sorted(m for m in loaded for f in forbidden if m == f or m.startswith(f + "."))
    assert not bad, f"contbatch.engine loads {bad}"
    offenders = []
    for path in Path(contbatch.engine.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            if names & {"asyncio", "fastapi", "transformers"}:
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders


def test_from_checkpoint_sizes_the_cache(ckpt: Path) -> None:
    spec, _ = load_checkpoint(ckpt)
    runner = ModelRunner.from_checkpoint(
        ckpt, kv_memory_bytes=5 * bytes_per_block(spec, 8, torch.float32), block_size=8, device="cpu"
    )
    assert (runner.kv_cache.num_blocks, runner.kv_cache.block_size, runner.model.dtype) == (5, 8, torch.float32)
    assert ModelRunner.from_checkpoint(ckpt, num_blocks=3, device="cpu").kv_cache.num_blocks == 3
    with pytest.raises(ValueError, match="exactly one"):
        ModelRunner.from_checkpoint(ckpt, device="cpu")
    with pytest.raises(ValueError, match="CUDA-only"):
        ModelRunner.from_checkpoint(ckpt, num_blocks=3, device="cpu", dtype="bfloat16")


def test_reaching_max_model_len_finishes_with_length(ckpt: Path) -> None:
    runner = _runner(ckpt, num_blocks=20)
    tokens = list(range(1, 64))  # max_position_embeddings is 64: the 64th token is the last one allowed
    seq = SequenceState(tokens, list(range(16)), SamplingParams(temperature=0.0, ignore_eos=True))
    result = runner.execute(build_output(0, [ScheduledChunk("r", 0, 63, True, True)]), {"r": seq})
    assert result.finished == {"r": FinishReason.LENGTH}
    longer = SequenceState([*tokens, 5, 6], list(range(17)))
    with pytest.raises(StepError, match="position 64 exceeds max_model_len 64"):
        runner.execute(build_output(1, [ScheduledChunk("r", 64, 1, False, True)]), {"r": longer})
