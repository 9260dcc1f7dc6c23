"""Loading a model for the engine and sizing the scheduler to it: one way, for the offline
engine (`LLMEngine`) and the server's engine backend alike.

`load_model` reads a local checkpoint directory (the built-in demo model without one) into a
`ModelRunner` whose paged KV cache takes `kv_cache_memory` bytes, plus its tokenizer.
`fit_scheduler` gives a scheduler config the runner's block count and block size, and caps its
`max_model_len` at the model's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from contbatch.core.config import KVConfig, SchedulerConfig
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.runner import ModelRunner
from contbatch.engine.tokenizer import Tokenizer

DEFAULT_KV_CACHE_MEMORY = 256 * 1024**2  # bytes of paged KV cache


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path
    runner: ModelRunner
    tokenizer: Tokenizer


def load_model(
    model: str | Path | None,
    *,
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
    block_size: int = 16,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
) -> LoadedModel:
    """The checkpoint `model` (None: the demo model) with a KV cache of `kv_cache_memory` bytes."""
    if kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {kv_cache_memory}")
    path = Path(model) if model else ensure_demo_model()
    runner = ModelRunner.from_checkpoint(
        path, kv_memory_bytes=kv_cache_memory, block_size=block_size, device=device, dtype=dtype, seed=seed
    )
    return LoadedModel(path, runner, Tokenizer.from_dir(path))


def fit_scheduler(config: SchedulerConfig, runner: ModelRunner) -> SchedulerConfig:
    """`config` with the runner's KV cache (blocks, block size) and at most its model length."""
    cache = runner.kv_cache
    kv = dataclasses.replace(config.kv or KVConfig(), num_blocks=cache.num_blocks, block_size=cache.block_size)
    limit = runner.spec.max_model_len
    return dataclasses.replace(config, kv=kv, max_model_len=min(config.max_model_len or limit, limit))
