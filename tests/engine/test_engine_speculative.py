"""Speculative decoding with prompt-lookup (n-gram) drafts: the proposer (vLLM's rule: the
longest suffix n-gram in [min, max] that occurred earlier, its most recent occurrence), and the
engine token-exact with non-speculative decoding on a random checkpoint of the demo's 30M shape:
greedy and seeded sampling, with penalties, under chunked prefill and preemption (recompute and
swap), stop tokens inside accepted drafts, and drafts that would pass max_model_len."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from contbatch.core import FinishReason, SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.engine.demo import DEMO_SHAPE, ensure_demo_model, write_random_checkpoint
from contbatch.engine.executor import ModelExecutor
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.engine.ngram import pack, propose_ngram
from contbatch.engine.runner import ModelRunner
from contbatch.loop.params import SamplingParams

BLOCK_SIZE = 16


def with_demo_tokenizer(path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_model() / name, path / name)
    return path


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "want"),
    [
        ([1, 2, 3, 4, 1, 2], 3, 1, 3, [3, 4, 1]),
        ([1, 2, 3, 9, 5, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3, [7, 1]),  # the most recent occurrence
        ([1, 2, 3, 9, 5, 3, 8, 1, 2, 3], 2, 1, 3, [9, 5]),  # the longest n-gram before a shorter, later one
        ([5, 6, 7], 2, 1, 3, []),  # no earlier occurrence
        ([7, 7, 7, 7], 3, 1, 2, [7]),  # only one token follows the latest match
        ([4, 5, 6, 4, 5], 5, 3, 3, []),  # below prompt_lookup_min
        ([1, 2, 1, 2], 0, 1, 2, []),
        ([256, 1, 256], 2, 1, 1, [1, 256]),  # byte patterns across token boundaries do not match
        ([1 << 40, 3, 1 << 40], 1, 1, 1, [3]),
    ],
)
def test_ngram_proposer(tokens: list[int], k: int, min_n: int, max_n: int, want: list[int]) -> None:
    assert propose_ngram(tokens, k, min_n, max_n) == want
    packed = pack(tokens[:1])
    packed += pack(tokens[1:])  # kept per sequence and extended, as the executor does
    assert propose_ngram(tokens, k, min_n, max_n, packed) == want


def test_a_packed_copy_must_match_the_sequence() -> None:
    with pytest.raises(ValueError, match="packed"):
        propose_ngram([1, 2, 1], 2, 1, 2, pack([1, 2]))


def test_misaligned_byte_matches_are_skipped() -> None:
    # packed as 8-byte words, [x, 0] followed by [0, y] contains [0, 0] at a misaligned offset
    tokens = [1 << 56, 1, 0, 0]
    assert propose_ngram(tokens, 2, 1, 2) == [0]


def test_executor_validates_the_lookup_bounds() -> None:
    with pytest.raises(ValueError, match="prompt_lookup"):
        ModelExecutor(object(), prompt_lookup_min=3, prompt_lookup_max=2)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_random_checkpoint(tmp_path_factory.mktemp("spec30m"), DEMO_SHAPE, seed=5, demo=False)
    return with_demo_tokenizer(path)


def _block_bytes() -> int:
    shape = DEMO_SHAPE
    head_dim = shape.hidden_size // shape.num_heads
    return 2 * shape.num_layers * shape.num_kv_heads * head_dim * BLOCK_SIZE * 4


def make_engine(path: Path, *, k: int, num_blocks: int = 256, budget: int = 8192, **kv: Any) -> LLMEngine:
    kv_config = KVConfig(watermark=0.0, **kv)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, num_speculative_tokens=k, kv=kv_config)
    return LLMEngine(
        EngineConfig(
            model=str(path), kv_cache_memory=num_blocks * _block_bytes(), block_size=BLOCK_SIZE, scheduler=scheduler
        )
    )


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(2)
    random = {f"r{i}": torch.randint(3, 32_000, (n,), generator=g).tolist() for i, n in enumerate((9, 37))}
    return {"rep": [11, 22, 33, 44, 55] * 8, "loop": [7, 8] * 10, **random}


def generate(
    engine: LLMEngine, given: dict[str, list[int]], params: SamplingParams
) -> dict[str, tuple[list[int], FinishReason | None]]:
    requests = {rid: engine.add_request(p, params, request_id=rid) for rid, p in given.items()}
    while engine.has_unfinished():
        engine.step()
    return {rid: (list(r.output_token_ids), r.finish_reason) for rid, r in requests.items()}


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=0.2, repetition_penalty=1.1),
    ],
    ids=["greedy", "seeded-sampling", "penalties"],
)
def test_speculation_is_token_exact(checkpoint: Path, params: SamplingParams) -> None:
    given = prompts()
    want = generate(make_engine(checkpoint, k=0), given, params)
    engine = make_engine(checkpoint, k=4)
    got = generate(engine, given, params)
    assert got == want
    stats = engine.scheduler.stats
    assert stats.num_draft_tokens > 0
    if params is GREEDY:
        assert stats.num_accepted_draft_tokens > 0  # the random model loops; its loops are guessed


@pytest.mark.slow
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_speculation_is_token_exact_under_chunked_prefill_and_preemption(checkpoint: Path, preemption: str) -> None:
    given = prompts()
    want = generate(make_engine(checkpoint, k=0), given, GREEDY)
    extra = {"num_host_blocks": 64} if preemption == "swap" else {}
    engine = make_engine(checkpoint, k=3, num_blocks=12, budget=16, preemption=preemption, **extra)
    got = generate(engine, given, GREEDY)
    assert got == want
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_accepted_draft_tokens > 0
    assert (stats.num_swap_outs > 0) == (preemption == "swap")


@pytest.mark.slow
def test_a_stop_token_inside_accepted_drafts_ends_there(checkpoint: Path) -> None:
    given = {"rep": prompts()["rep"]}
    plain, _ = generate(make_engine(checkpoint, k=0), given, GREEDY)["rep"]
    stop = plain[12]
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    want = generate(make_engine(checkpoint, k=0), given, params)
    got = generate(make_engine(checkpoint, k=4), given, params)
    assert got == want and got["rep"][1] is FinishReason.STOP
    assert got["rep"][0][-1] == stop and len(got["rep"][0]) <= 13


@pytest.mark.slow
def test_drafts_stop_at_max_model_len(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, k=4)
    limit = engine.max_model_len
    prompt = [9, 10] * ((limit - 10) // 2)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    got = generate(engine, {"long": prompt}, params)["long"]
    want = generate(make_engine(checkpoint, k=0), {"long": prompt}, params)["long"]
    assert got == want and len(prompt) + len(got[0]) == limit


def test_shortened_chunks_and_acceptance_counts(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, k=3)
    generate(engine, {"r": prompts()["r0"]}, dataclasses.replace(GREEDY, max_tokens=8))
    executor = engine.core.executor
    assert isinstance(executor, ModelExecutor) and isinstance(executor.runner, ModelRunner)
    stats = engine.scheduler.stats
    # the scheduler counts every planned draft position; the executor only the drafts it found
    assert executor.num_accepted_tokens == stats.num_accepted_draft_tokens
    assert executor.num_proposed_tokens <= stats.num_draft_tokens
