"""Loading a model for the engine and sizing the scheduler to it: one way, for the offline
engine (`LLMEngine`) and the server's engine backend alike.

`load_model` reads a local checkpoint directory (the built-in demo model without one) into a
`ModelRunner` whose paged KV cache takes `kv_cache_memory` bytes, plus its tokenizer.
`fit_scheduler` gives a scheduler config the runner's block count and block size, and caps its
`max_model_len` at the model's. `warm_up` runs, on CUDA, a step as large as that config allows
before the first request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from contbatch.core.config import KVConfig, SchedulerConfig
from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.runner import ModelRunner, SequenceState
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


def warm_up(runner: ModelRunner, config: SchedulerConfig, *, devices: tuple[str, ...] = ("cuda",)) -> None:
    """On CUDA (a device type in `devices`), before any request: a prefill of the whole token
    budget (one sequence, up to `max_model_len` and half the cache), then a decode of up to
    `max_num_seqs` rows of different contexts, greedy (the runner keeps no state of an unseeded
    request, so there is nothing to forget after). Nothing on other devices.

    CUDA loads a kernel's module on its first use, and the caching allocator grows its pool as
    steps grow: without this the first burst of requests pays for both (on an H200 the engine's own
    mean TTFT for a first burst of 48 requests was about twice the later bursts', and 1.05-1.4 x
    with it: `benchmarks/first_burst.py`). A step too large for the device fails here, at start,
    not under the first burst.

    Invariant: it runs before the scheduler hands out any block, so the blocks it writes hold no
    request's KV, and every slot is written before a later request reads it.
    """
    if runner.device.type not in devices:
        return
    cache, limit = runner.kv_cache, config.max_model_len or runner.spec.max_model_len
    bs = cache.block_size
    tokens = max(1, min(config.max_num_batched_tokens, limit - 1, cache.num_blocks // 2 * bs))
    used = -(-tokens // bs)
    prefill = {"warm-up": SequenceState([1] * tokens, range(used))}
    rows = min(config.max_num_seqs or 256, config.max_num_batched_tokens, (cache.num_blocks - used) // 2)
    decodes = {  # contexts of 1 to bs tokens, two blocks each
        f"warm-up-{i}": SequenceState([1] * (i % bs + 2), (used + 2 * i, used + 2 * i + 1)) for i in range(rows)
    }
    runner.execute(build_output(0, [ScheduledChunk("warm-up", 0, tokens, True, True)]), prefill)
    chunks = [ScheduledChunk(rid, len(seq.token_ids) - 1, 1, False, True) for rid, seq in decodes.items()]
    if chunks:
        runner.execute(build_output(1, chunks), decodes)
