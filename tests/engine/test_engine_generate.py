"""Greedy generation by the runner, driven by hand with `build_output` (continuous batching: prompts of
different lengths prefilled together, then decoded together), equals transformers'
`generate(do_sample=False)` token for token on a random model of the demo's 30M shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.core.status import FinishReason
from contbatch.engine.demo import DEMO_SHAPE, write_random_checkpoint
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.loader import load_checkpoint
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.loop.params import SamplingParams

BLOCK_SIZE = 16
NUM_NEW = 12


@pytest.fixture(scope="module")
def demo_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("demo30m"), DEMO_SHAPE, seed=7, demo=False)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    return {f"p{i}": torch.randint(3, 32_000, (n,), generator=g).tolist() for i, n in enumerate((5, 23, 61))}


def _hf_generate(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NUM_NEW,
            min_new_tokens=NUM_NEW,  # no early EOS: compare the same number of tokens
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _engine_generate(path: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    spec, weights = load_checkpoint(path)
    runner = ModelRunner(spec, weights, PagedKVCache(spec, 64, BLOCK_SIZE))
    tokens = {rid: list(p) for rid, p in prompts.items()}
    tables, next_block = {}, 0
    for rid, p in prompts.items():
        need = -(-(len(p) + NUM_NEW) // BLOCK_SIZE)
        tables[rid], next_block = list(range(next_block, next_block + need))[::-1], next_block + need
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    chunks = [ScheduledChunk(rid, 0, len(p), True, True) for rid, p in prompts.items()]
    for step in range(NUM_NEW):
        seqs = {rid: SequenceState(tokens[rid], tables[rid], params) for rid in prompts}
        result = runner.execute(build_output(step, chunks), seqs)
        assert not result.finished
        for rid, new in result.sampled_token_ids.items():
            tokens[rid].extend(new)
        chunks = [ScheduledChunk(rid, len(t) - 1, 1, False, True) for rid, t in tokens.items()]
    return {rid: tokens[rid][len(p) :] for rid, p in prompts.items()}


def test_greedy_equals_transformers_generate(demo_shaped: Path) -> None:
    from transformers import LlamaForCausalLM

    prompts = _prompts()
    got = _engine_generate(demo_shaped, prompts)
    model = LlamaForCausalLM.from_pretrained(demo_shaped, dtype=torch.float32).eval()
    for rid, prompt in prompts.items():
        want = _hf_generate(model, prompt)
        assert got[rid] == want, rid
    assert len({t for out in got.values() for t in out}) > 5  # a varied, not degenerate, output


def test_eos_and_stop_token_ids_finish_with_stop(demo_shaped: Path) -> None:
    spec, weights = load_checkpoint(demo_shaped)
    runner = ModelRunner(spec, weights, PagedKVCache(spec, 8, BLOCK_SIZE))
    prompt = _prompts()["p1"]
    chunk = [ScheduledChunk("r", 0, len(prompt), True, True)]
    first = runner.execute(build_output(0, chunk), {"r": SequenceState(prompt, [0, 1])}).sampled_token_ids["r"][0]

    def finish(params: SamplingParams, eos: tuple[int, ...]) -> object:
        r = ModelRunner(spec, runner.model, PagedKVCache(spec, 8, BLOCK_SIZE), eos_token_ids=eos)
        return r.execute(build_output(0, chunk), {"r": SequenceState(prompt, [0, 1], params)}).finished.get("r")

    greedy = SamplingParams(temperature=0.0)
    assert finish(greedy, ()) is None
    assert finish(greedy, (first,)) is FinishReason.STOP
    assert finish(SamplingParams(temperature=0.0, ignore_eos=True), (first,)) is None
    assert finish(SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=(first,)), ()) is FinishReason.STOP
