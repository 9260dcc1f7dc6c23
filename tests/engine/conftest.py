"""Shared builders for engine tests: tiny random checkpoints written by transformers into tmp dirs,
reference logits from transformers' own forward, and a hand-driven runner (no scheduler).

Devices: the `device` fixture runs a test once per device, "cpu" and "cuda". The cuda case carries
the `cuda` marker (`pytest -m cuda` selects it; benchmarks/gpu_check.sh runs that) and is skipped
when torch sees no CUDA device, so the same test body always runs on the CPU.

Everything is local: no network, no hub lookups (HF_HUB_OFFLINE is set for the session).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from contbatch.engine.spec import ARCHITECTURES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY: dict[str, Any] = {
    "vocab_size": 211,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, NO_CUDA])
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test that takes it runs on the CPU and, under the `cuda` marker, on CUDA."""
    return torch.device(request.param)


@dataclass
class HFCheckpoint:
    path: Path
    model: Any  # transformers *ForCausalLM in eval mode, float32

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """transformers' logits [len, vocab] for one sequence (full forward, no cache)."""
        with torch.no_grad():
            return self.model(torch.tensor([list(token_ids)])).logits[0].float()


def _model_class(model_type: str) -> Any:
    """transformers' *ForCausalLM class of a supported `model_type` (from the engine's registry)."""
    import transformers

    return getattr(transformers, ARCHITECTURES[model_type].hf_class)


def _config(model_type: str, **overrides: Any) -> Any:
    kwargs = {**TINY, **ARCHITECTURES[model_type].full_attention_config, **overrides}
    return _model_class(model_type).config_class(**kwargs)


def build_hf_checkpoint(path: Path, model_type: str = "llama", *, seed: int = 0, **overrides: Any) -> HFCheckpoint:
    """A random transformers model saved with `save_pretrained` (safetensors) into `path`."""
    torch.manual_seed(seed)
    config = _config(model_type, **overrides)
    model = _model_class(model_type)(config).eval()
    with torch.no_grad():  # random biases and norms, so a wrongly ignored tensor shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return HFCheckpoint(path, model)


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., HFCheckpoint]:
    counter = iter(range(1000))

    def make(model_type: str = "llama", **overrides: Any) -> HFCheckpoint:
        return build_hf_checkpoint(tmp_path / f"ckpt{next(counter)}", model_type, **overrides)

    return make


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()
