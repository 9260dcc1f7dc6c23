"""The engine loop (`LLMEngine`, `LLM.generate`): the core scheduler driving the real model.

Greedy outputs equal transformers' `generate` token for token under continuous batching with
chunked prefill (a token budget smaller than the prompts) and with preemption by recompute and
by swap (a KV cache too small for every request at once); a failing step ends only its own
requests; bad requests are refused clearly and the engine keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contbatch.core import FinishReason, SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.engine.api import LLM
from contbatch.engine.demo import DEMO_SHAPE, train_tokenizer, write_random_checkpoint, write_tokenizer
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.loop.params import SamplingParams

NUM_NEW = 10
BLOCK_BYTES = 2 * 6 * 2 * 64 * 16 * 4  # K and V x layers x KV heads x head dim x block size x float32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_random_checkpoint(tmp_path_factory.mktemp("loop30m"), DEMO_SHAPE, seed=7, demo=False)
    write_tokenizer(path, train_tokenizer(vocab_size=400, corpus=["a small local corpus for a tiny tokenizer"] * 50))
    return path


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[int, list[int]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = {}
    for i, prompt in enumerate(_prompts()):
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NUM_NEW,
                min_new_tokens=NUM_NEW,
                pad_token_id=0,
            )
        out[i] = ids[0, len(prompt) :].tolist()
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 32_000, (n,), generator=g).tolist() for n in (5, 23, 61, 40)]


def _engine(checkpoint: Path, *, num_blocks: int, preemption: str = "recompute", budget: int = 24) -> LLMEngine:
    kv = KVConfig(preemption=preemption, num_host_blocks=64, watermark=0.0)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, kv=kv)
    return LLMEngine(EngineConfig(model=str(checkpoint), kv_cache_memory=num_blocks * BLOCK_BYTES, scheduler=scheduler))


@pytest.mark.parametrize(("num_blocks", "preemption"), [(64, "recompute"), (6, "recompute"), (6, "swap")])
def test_greedy_equals_transformers_under_continuous_batching(
    checkpoint: Path, expected: dict[int, list[int]], num_blocks: int, preemption: str
) -> None:
    engine = _engine(checkpoint, num_blocks=num_blocks, preemption=preemption)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in _prompts()]
    while engine.has_unfinished():
        engine.step()
    for i, request in enumerate(requests):
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_token_ids == expected[i], i
    stats = engine.scheduler.stats
    if num_blocks < 64:
        assert stats.num_preemptions > 0
        assert (stats.num_swap_outs > 0) == (preemption == "swap")
    assert engine.scheduler.memory is not None and engine.scheduler.memory.kv.num_used_blocks == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_offline_engine_hits_the_prefix_cache_with_the_same_greedy_outputs(
    checkpoint: Path, expected: dict[int, list[int]], preemption: str
) -> None:
    """Prefix caching through `LLMEngine` (the intake computes the prompt block hashes): the
    second of two equal 61-token prompts finds its 3 full blocks (48 tokens) cached, and every
    greedy output equals transformers', with and without prefix caching, also when a small cache
    preempts."""
    prompts = _prompts()
    twice = [prompts[2], prompts[2], *prompts]  # the 61-token prompt, twice, then all four
    want = [expected[2], expected[2], *(expected[i] for i in range(len(prompts)))]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = {}
    for caching in (False, True):
        kv = KVConfig(preemption=preemption, num_host_blocks=64, watermark=0.0, enable_prefix_caching=caching)
        config = EngineConfig(
            model=str(checkpoint),
            kv_cache_memory=24 * BLOCK_BYTES,
            scheduler=SchedulerConfig(max_num_batched_tokens=256, kv=kv),
        )
        engine = LLMEngine(config)
        first = engine.add_request(twice[0], params)
        while engine.has_unfinished():  # the first finishes: its blocks stay cached
            engine.step()
        requests = [first] + [engine.add_request(p, params) for p in twice[1:]]
        while engine.has_unfinished():
            engine.step()
        outputs[caching] = [r.output_token_ids for r in requests]
        stats = engine.scheduler.stats
        assert stats.num_prefix_hit_tokens == (48 + 48 if caching else 0)  # both later copies hit 3 blocks
    assert outputs[True] == outputs[False] == want


def test_a_failing_step_ends_only_its_requests(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(checkpoint, num_blocks=64, budget=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = engine.add_request([5, 6, 7], params)
    original = engine.runner.compute_logits
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.runner, "compute_logits", flaky)
    outputs = engine.step() + engine.step()
    assert first.finish_reason is FinishReason.ERROR and "injected failure" in first.finish_detail
    assert [o.finish_reason for o in outputs if o.request_id == first.request_id][-1] is FinishReason.ERROR
    second = engine.add_request([8, 9], params)
    while engine.has_unfinished():
        engine.step()
    assert second.finish_reason is FinishReason.LENGTH and len(second.output_token_ids) == 4


def test_bad_requests_are_refused_and_the_engine_keeps_serving(checkpoint: Path) -> None:
    engine = _engine(checkpoint, num_blocks=8, budget=256)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    too_long = engine.add_request(list(range(3, 3 + 200)), SamplingParams(max_tokens=8))
    assert too_long.finish_reason is FinishReason.REJECTED and "KV blocks" in too_long.finish_detail
    ok = engine.add_request([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert ok.finish_reason is FinishReason.LENGTH


def test_llm_generate_returns_text_in_prompt_order(checkpoint: Path) -> None:
    llm = LLM(config=EngineConfig(model=str(checkpoint), kv_cache_memory=64 * BLOCK_BYTES))
    outputs = llm.generate(["a small", "local corpus"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [5, 5]
    assert all(o.finish_reason is FinishReason.LENGTH and o.timeline.first_token_ts is not None for o in outputs)
    assert outputs[0].request_id != outputs[1].request_id


@pytest.mark.parametrize("variant", ["llama_mha_tied", "rope_llama3", "rope_linear", "qwen2_biases_tied"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_greedy_equals_transformers_on_tiny_variants(hf_checkpoint: object, variant: str, preemption: str) -> None:
    """Tiny random checkpoints (no GQA and tied embeddings, rope scaling, Qwen2 biases), several
    requests at once, chunked prefill (budget 8) and a cache too small for all of them."""
    from test_engine_model import VARIANTS  # type: ignore[import-not-found]

    model_type, overrides = VARIANTS[variant]
    ckpt = hf_checkpoint(model_type, **overrides)  # type: ignore[operator]
    write_tokenizer(ckpt.path, train_tokenizer(vocab_size=300, corpus=["tiny corpus for a tiny model"] * 20))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (3, 17, 11)]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            ids = ckpt.model.generate(torch.tensor([prompt]), attention_mask=mask, do_sample=False, max_new_tokens=8,
                                      min_new_tokens=8, pad_token_id=0)  # fmt: skip
        want.append(ids[0, len(prompt) :].tolist())
    kv_bytes = (
        2 * 2 * overrides.get("num_key_value_heads", 2) * overrides.get("head_dim", 16) * 4 * 4
    )  # per 4-token block
    kv = KVConfig(block_size=4, preemption=preemption, num_host_blocks=32, watermark=0.0)
    config = EngineConfig(model=str(ckpt.path), kv_cache_memory=9 * kv_bytes, block_size=4,
                          scheduler=SchedulerConfig(max_num_batched_tokens=8, kv=kv))  # fmt: skip
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == want
    assert engine.scheduler.stats.num_preemptions > 0
