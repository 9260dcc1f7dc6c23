"""A tiny demo-style checkpoint (weights and tokenizer) shared by the calibration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from contbatch.engine.demo import DemoShape, create_demo_model
from contbatch.engine.demo_corpus import demo_corpus

TINY = DemoShape(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=300,
    max_position_embeddings=256,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = list(demo_corpus(num_lines=800, lexicon_size=800))
    return create_demo_model(tmp_path_factory.mktemp("calibrate") / "tiny", TINY, corpus=corpus)
