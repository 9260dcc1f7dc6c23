"""Engine log-probabilities equal transformers' log-softmax (to 1e-4) on a random checkpoint of
the demo's 30M shape: the sampled tokens' (`logprobs`: value, rank, top k) and the prompt's
(`prompt_logprobs`, the first token None), through the whole loop (`LLMEngine`), under chunked
prefill, with sampling (the raw distribution: temperature does not change them), with prefix
caching on (such requests are not served from the cache) and with speculative decoding."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from contbatch.core import SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.core.outputs import TokenLogprobs
from contbatch.engine.demo import DEMO_SHAPE, ensure_demo_model, write_random_checkpoint
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.loop import RequestOutput
from contbatch.loop.params import SamplingParams

TOL = 1e-4
K = 5


def with_demo_tokenizer(path: Path) -> Path:
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_random_checkpoint(tmp_path_factory.mktemp("demo30m"), DEMO_SHAPE, seed=7, demo=False)
    return with_demo_tokenizer(path)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_logprobs(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """[len, vocab]: row i is transformers' log-softmax of the distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([list(token_ids)])).logits[0].float(), dim=-1)


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[RequestOutput]]:
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=rid)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    for out in engine.core.take_outputs():
        outputs.setdefault(out.request_id, []).append(out)
    return outputs


def check_entry(entry: TokenLogprobs, row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(row[token])) < TOL
    value = float(row[token])
    assert int((row > value + TOL).sum()) + 1 <= entry.rank <= int((row > value - TOL).sum()) + 1
    values, ids = row.topk(k)
    assert len(entry.top) == k
    for (got_id, got_lp), want_id, want_lp in zip(entry.top, ids.tolist(), values.tolist(), strict=True):
        assert abs(got_lp - want_lp) < TOL
        assert got_id == want_id or abs(float(row[got_id]) - want_lp) < TOL  # a tie may order either way


def check_against_transformers(
    model: Any, prompt: list[int], outputs: list[RequestOutput], *, prompt_k: int | None
) -> None:
    tokens = [t for out in outputs for t in out.token_ids]
    entries = [e for out in outputs for e in out.logprobs]
    assert len(entries) == len(tokens) > 0
    want = hf_logprobs(model, prompt + tokens)
    for j, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        check_entry(entry, want[len(prompt) - 1 + j], token, K)
    given = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    if prompt_k is None:
        assert given == []
        return
    assert len(given) == 1 and len(given[0]) == len(prompt)
    first, *rest = given[0]
    assert first is None
    for i, entry in enumerate(rest, start=1):
        assert entry is not None
        check_entry(entry, want[i - 1], prompt[i], prompt_k)


def prompts(seed: int = 3) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randint(3, 32_000, (n,), generator=g).tolist() for i, n in enumerate((7, 41, 23))}


def engine(path: Path, **scheduler: Any) -> LLMEngine:
    kv = scheduler.pop("kv", KVConfig())
    return LLMEngine(EngineConfig(model=str(path), scheduler=SchedulerConfig(kv=kv, **scheduler)))


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_and_prompt_logprobs_equal_transformers_under_chunked_prefill(
    checkpoint: Path, hf_model: Any, temperature: float
) -> None:
    params = SamplingParams(
        temperature=temperature, seed=11, max_tokens=6, ignore_eos=True, logprobs=K, prompt_logprobs=3
    )
    llm = engine(checkpoint, max_num_batched_tokens=16)  # the 41-token prompt takes three chunks
    given = prompts()
    outputs = run(llm, given, params)
    for rid, prompt in given.items():
        check_against_transformers(hf_model, prompt, outputs[rid], prompt_k=3)


@pytest.mark.slow
def test_only_requests_that_ask_get_logprobs(checkpoint: Path, hf_model: Any) -> None:
    llm = engine(checkpoint)
    given = prompts(seed=4)
    llm.add_request(given["p0"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), request_id="plain")
    outputs = run(llm, {"p1": given["p1"]}, SamplingParams(temperature=0.0, max_tokens=4, logprobs=K, ignore_eos=True))
    check_against_transformers(hf_model, given["p1"], outputs["p1"], prompt_k=None)
    assert sum(len(o.token_ids) for o in outputs["plain"]) == 4
    assert all(not o.logprobs and o.prompt_logprobs is None for o in outputs["plain"])


@pytest.mark.slow
def test_prompt_logprobs_with_prefix_caching_compute_the_whole_prompt(checkpoint: Path, hf_model: Any) -> None:
    llm = engine(checkpoint, kv=KVConfig(enable_prefix_caching=True))
    prompt = prompts(seed=5)["p1"]
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    run(llm, {"warm": prompt}, plain)
    run(llm, {"hit": prompt}, plain)
    hits = llm.scheduler.stats.num_prefix_hit_tokens
    assert hits > 0  # the prompt's blocks are cached
    asked = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    outputs = run(llm, {"again": prompt}, asked)
    check_against_transformers(hf_model, prompt, outputs["again"], prompt_k=K)
    assert llm.scheduler.stats.num_prefix_hit_tokens == hits  # computed whole, not read from the cache


@pytest.mark.slow
def test_logprobs_under_speculative_decoding(checkpoint: Path, hf_model: Any) -> None:
    llm = engine(checkpoint, num_speculative_tokens=3)
    repetitive = {"rep": [101, 202, 303, 404] * 6, **prompts(seed=6)}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=K)
    outputs = run(llm, repetitive, params)
    for rid, prompt in repetitive.items():
        check_against_transformers(hf_model, prompt, outputs[rid], prompt_k=None)
    assert llm.scheduler.stats.num_accepted_draft_tokens > 0


@pytest.mark.slow
def test_the_offline_api_returns_them(checkpoint: Path, hf_model: Any) -> None:
    from contbatch.engine.api import LLM

    prompt = prompts(seed=8)["p2"]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    (out,) = LLM(str(checkpoint)).generate(prompt, params)
    assert len(out.logprobs) == 3 and out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    want = hf_logprobs(hf_model, prompt + list(out.token_ids))
    assert abs(out.logprobs[-1].logprob - float(want[-2, out.token_ids[-1]])) < TOL
