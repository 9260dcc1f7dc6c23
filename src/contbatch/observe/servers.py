"""Scheduler configurations of the servers people run, as presets for `contbatch fit`.

Each `ServerPreset` is a preset of `contbatch.core.config.PRESETS` plus ``KEY=VALUE`` overrides
in the ``--set`` syntax (`contbatch.cli.options.scheduler_config` applies them), with the source
its values come from. `SERVER_PRESETS` is the registry; ``fit --server NAME --set KEY=VALUE``
overrides any field (the KV cache size of a real deployment is never a default: set
``kv.num_blocks`` to what the server logs at start-up).

- ``contbatch``: `contbatch serve` with its default ``--preset engine``;
- ``vllm``: the core's ``vllm`` preset (vLLM V1's scheduler, decision for decision: an 8,192-token
  budget, 256 sequences, chunked prefill, 16-token blocks, prefix caching, recompute), unchanged;
- ``transformers-cb``: ``transformers serve --continuous-batching`` (transformers 5.x,
  `generation/continuous_batching/scheduler.py` and `ContinuousBatchingConfig`): the ``fifo``
  scheduler serves decoding requests first, then splits prompts under ``max_batch_tokens`` (8,192
  when not inferred from memory), at most ``max_requests_per_batch`` requests (fallback 1,024),
  pages of 256 tokens (``page_size``), block sharing for prefixes, and no new prefill while fewer
  than 15 % of blocks are free (``safety_margin`` 0.15: a watermark); requests that do not fit
  are evicted and recomputed (no CPU offload by default). Its second budget, the KV tokens read
  per batch, is the whole cache (``cache.max_tokens_read``: pages x page size), never tighter
  than the pool; on CPU every batch runs one dense masked attention (no decode fast path), which
  a fitted cost prices with its batch-pair term;
- ``sglang``: SGLang's documented server arguments: ``--chunked-prefill-size`` 8,192 (GPU
  dependent), ``--max-running-requests`` (here 256), a radix prefix cache, token-level KV (block
  1), and admission against a decaying estimate of the outputs still to come
  (``--schedule-conservativeness``: the ``estimate`` admission mode), recompute on retraction;
- ``tgi``: text-generation-inference's launcher defaults: ``--max-batch-prefill-tokens`` 4,096,
  ``--max-batch-total-tokens`` (memory bound), ``--max-concurrent-requests`` 128, block 16 (paged
  attention), prefill chunking on recent versions, and a request's whole budget (prompt plus
  ``max_new_tokens``) reserved at admission, so it never preempts (``reserve``).

What the documentation does not state (and what differs by version or GPU) stays at the base
preset's value; ``fit`` prints the config it used so a reader can see every field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerPreset:
    base: str  # a name in contbatch.core.config.PRESETS
    overrides: tuple[str, ...]  # KEY=VALUE, as --set takes them
    source: str  # one line: where the values come from


SERVER_PRESETS: dict[str, ServerPreset] = {
    "contbatch": ServerPreset("engine", (), "contbatch serve's default scheduler (--preset engine)"),
    "vllm": ServerPreset("vllm", (), "vLLM V1 scheduler defaults (the core's vllm preset)"),
    "transformers-cb": ServerPreset(
        "engine",
        (
            "max_num_batched_tokens=8192",
            "max_num_seqs=1024",
            "chunked_prefill=true",
            "kv.block_size=256",
            "kv.watermark=0.15",
            "kv.enable_prefix_caching=true",
            "kv.preemption=recompute",
        ),
        "transformers 5.x continuous batching: fifo scheduler, ContinuousBatchingConfig defaults",
    ),
    "sglang": ServerPreset(
        "engine",
        (
            "max_num_batched_tokens=8192",
            "max_num_seqs=256",
            "chunked_prefill=true",
            "kv.block_size=1",
            "kv.enable_prefix_caching=true",
            "kv.admission=estimate",
            "kv.preemption=recompute",
        ),
        "SGLang server arguments as documented (chunked prefill 8192, radix cache, estimate admission)",
    ),
    "tgi": ServerPreset(
        "engine",
        (
            "max_num_batched_tokens=4096",
            "max_num_seqs=128",
            "chunked_prefill=true",
            "kv.block_size=16",
            "kv.admission=reserve",
        ),
        "text-generation-inference launcher defaults as documented (prefill 4096, 128 concurrent, reserve)",
    ),
}


def server_overrides(name: str) -> tuple[str, ServerPreset]:
    """(the core preset, the server preset) of `name`; ValueError naming the known ones."""
    preset = SERVER_PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown server {name!r}; known: {', '.join(SERVER_PRESETS)}")
    return preset.base, preset
