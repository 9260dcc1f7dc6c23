"""The demo model: deterministic, labelled, a normal HF checkpoint directory, created atomically once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.engine import demo
from contbatch.engine.demo import DEMO_SHAPE, DemoShape, create_demo_model, ensure_demo_model, random_weights
from contbatch.engine.demo_corpus import demo_corpus
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.loader import load_checkpoint
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.engine.tokenizer import Tokenizer
from contbatch.loop.params import SamplingParams

TINY = DemoShape(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    vocab_size=300,
    max_position_embeddings=128,
)


def _tiny_corpus() -> list[str]:
    return list(demo_corpus(num_lines=800, lexicon_size=800))


def test_demo_shape_is_the_30m_model() -> None:
    s = DEMO_SHAPE
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size) == (384, 6, 6, 2, 1024)
    assert (s.vocab_size, s.tie_word_embeddings, s.max_position_embeddings) == (32_000, False, 4096)


def test_weights_and_corpus_are_deterministic() -> None:
    a, b = random_weights(TINY, seed=3), random_weights(TINY, seed=3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], random_weights(TINY, seed=4)["lm_head.weight"])
    assert list(demo_corpus(num_lines=50)) == list(demo_corpus(num_lines=50))


def test_tiny_demo_is_a_labelled_checkpoint_that_runs(tmp_path: Path) -> None:
    path = create_demo_model(tmp_path / "d", TINY, corpus=_tiny_corpus())
    config = json.loads((path / "config.json").read_text())
    assert config["contbatch_demo"] is True
    assert "meaningless" in (path / "README.txt").read_text()
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == 300 and tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    assert isinstance(prompt, list) and prompt[0] == tok.token_to_id("<|user|>")
    spec, weights = load_checkpoint(path)
    assert spec.eos_token_ids == (tok.eos_token_id,) and spec.bos_token_id == tok.bos_token_id
    runner = ModelRunner(spec, weights, PagedKVCache(spec, 8, 16))
    seq = SequenceState(prompt, [0, 1], SamplingParams(temperature=0.0))
    result = runner.execute(build_output(0, [ScheduledChunk("r", 0, len(prompt), True, True)]), {"r": seq})
    assert 0 <= result.sampled_token_ids["r"][0] < 300


def test_tiny_demo_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = create_demo_model(tmp_path / "d", TINY, corpus=_tiny_corpus())
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.hidden_size == 32
    hf_tok = AutoTokenizer.from_pretrained(path)
    assert hf_tok("hi there")["input_ids"] == Tokenizer.from_dir(path).encode("hi there")


def test_ensure_demo_model_creates_once_in_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def tiny(path: Path) -> Path:
        calls.append(Path(path))
        return create_demo_model(path, TINY, corpus=_tiny_corpus())

    monkeypatch.setattr(demo, "create_demo_model", tiny)
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path / "cache"))
    first = ensure_demo_model()
    assert first == tmp_path / "cache" / "demo-model" and (first / "model.safetensors").is_file()
    assert calls[0].parent == first.parent and calls[0] != first  # built aside, then renamed
    assert ensure_demo_model() == first and len(calls) == 1
    assert [p.name for p in first.parent.iterdir()] == ["demo-model"]  # no staging left behind
    assert first.stat().st_mode & 0o777 == 0o755 and (first / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_ensure_demo_model_loses_a_race_gracefully(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "demo"

    def racing(path: Path) -> Path:
        create_demo_model(target, TINY, corpus=_tiny_corpus())  # another process finishes first
        (Path(path) / "README.txt").write_text("ours")
        return Path(path)

    monkeypatch.setattr(demo, "create_demo_model", racing)
    assert ensure_demo_model(target) == target
    assert "meaningless" in (target / "README.txt").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


@pytest.mark.slow
def test_full_demo_model(tmp_path: Path) -> None:
    path = ensure_demo_model(tmp_path / "demo-model")
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == 32_000
    spec, _ = load_checkpoint(path)
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size, spec.tie_word_embeddings) == (384, 6, 32_000, False)
    text = "Hello, world! café 🙂"
    assert tok.decode(tok.encode(text)) == text
