"""`ModelRunner`: executes one `SchedulerOutput` on the real model and answers a `StepResult`.

Per step, in order:
1. forget requests in `finished_ids` (their generators, any host copy of their KV);
2. apply `swapped_out` then `swapped_in` (swapped-out blocks may be reused in the same step);
3. build the flat batch: single-token chunks first, sorted by context length (so the paged
   attention pads decodes little), then multi-token chunks in schedule order; positions, slots
   from each request's block table;
4. one forward; logits only for the last token of each chunk with `samples=True`;
5. sample each row with its request's `SamplingParams`; a sampled EOS (unless `ignore_eos`) or
   stop token id finishes the request with STOP, reaching `max_model_len` tokens with LENGTH.
   Stop strings are the engine loop's job; `max_tokens` is the scheduler's.

Any exception in a step is raised as `StepError` carrying the ids of the step's requests.

Invariants checked per chunk: the request has a `SequenceState`; its token ids cover the chunk;
its block table covers `start + num_new_tokens`; a sampling chunk ends at the last known token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, StepResult
from contbatch.core.status import FinishReason
from contbatch.engine.attention import AttentionMetadata, ChunkLayout, build_metadata
from contbatch.engine.kv_cache import PagedKVCache, num_blocks_for_memory
from contbatch.engine.loader import load_checkpoint
from contbatch.engine.model import LlamaModel, default_device, resolve_dtype
from contbatch.engine.sampling import Sampler
from contbatch.engine.spec import ModelSpec
from contbatch.loop.executor import StepError
from contbatch.loop.params import GREEDY, SamplingParams


class SequenceView(Protocol):
    """What the runner needs to know about one scheduled request (read only)."""

    @property
    def token_ids(self) -> Sequence[int]: ...  # prompt + output tokens so far (covers every position a chunk computes)

    @property
    def block_table(self) -> Sequence[int]: ...  # device block ids in token order

    @property
    def params(self) -> SamplingParams: ...


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A `SequenceView` as a value (tests, calibration grids)."""

    token_ids: Sequence[int]
    block_table: Sequence[int]
    params: SamplingParams = GREEDY


@dataclass(frozen=True, slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    sample_ids: tuple[str, ...]  # request id of each logits row, in row order


def _check_chunk(chunk: ScheduledChunk, seq: SequenceView | None, block_size: int) -> SequenceView:
    rid = chunk.request_id
    if seq is None:
        raise ValueError(f"request {rid!r} is scheduled but has no SequenceState")
    end = chunk.start + chunk.num_new_tokens
    if chunk.num_new_tokens < 1 or chunk.start < 0 or end > len(seq.token_ids):
        raise ValueError(f"request {rid!r}: chunk [{chunk.start}, {end}) outside its {len(seq.token_ids)} tokens")
    if len(seq.block_table) * block_size < end:
        raise ValueError(f"request {rid!r}: {len(seq.block_table)} blocks cannot hold {end} tokens")
    if chunk.samples and end != len(seq.token_ids):
        raise ValueError(
            f"request {rid!r}: a sampling chunk must end at its last token ({end} != {len(seq.token_ids)})"
        )
    return seq


def _flat_order(chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
    singles = sorted((c for c in chunks if c.num_new_tokens == 1), key=lambda c: c.start)
    return singles + [c for c in chunks if c.num_new_tokens > 1]


class ModelRunner:
    """Runs scheduler steps on a `LlamaModel` over a `PagedKVCache`; see the module docstring."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, torch.Tensor] | LlamaModel,
        kv_cache: PagedKVCache,
        *,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        """`weights`: the loader's tensors (a model is built on the cache's device and dtype) or a built model."""
        if isinstance(weights, LlamaModel):
            self.model = weights
        else:
            self.model = LlamaModel(spec, weights, dtype=kv_cache.dtype, device=kv_cache.device)
        if self.model.device != kv_cache.device or self.model.dtype != kv_cache.dtype:
            raise ValueError("the model and the KV cache must share a device and a dtype")
        self.spec = spec
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.eos_token_ids = frozenset(spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.sampler = Sampler(seed)
        self._generators: dict[str, torch.Generator] = {}

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        block_size: int = 16,
        device: torch.device | str | None = None,
        dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
    ) -> ModelRunner:
        """A runner for a local checkpoint with a KV cache of `num_blocks` blocks, or as many as fit in
        `kv_memory_bytes`. dtype None: float32 on CPU, the checkpoint's dtype on CUDA."""
        if (num_blocks is None) == (kv_memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_memory_bytes")
        spec, weights = load_checkpoint(path, max_model_len=max_model_len)
        dev = torch.device(device) if device is not None else default_device()
        kv_dtype = resolve_dtype(dtype if dtype is not None or dev.type == "cpu" else spec.dtype, dev)
        if kv_memory_bytes is not None:
            num_blocks = num_blocks_for_memory(spec, kv_memory_bytes, block_size, kv_dtype)
        kv = PagedKVCache(spec, num_blocks or 0, block_size, dtype=kv_dtype, device=dev)
        return cls(spec, weights, kv, seed=seed)

    # -- one step ------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, seqs: Mapping[str, SequenceView]) -> StepResult:
        """Run one step (see the module docstring); raises `StepError` naming the step's requests."""
        ids = [c.request_id for c in out.chunks]
        ids += [rid for rid, _ in out.swapped_out] + [rid for rid, _ in out.swapped_in]
        try:
            self._forget(out.finished_ids)
            self.apply_swaps(out)
            if not out.chunks:
                return StepResult()
            sample_ids, logits = self.compute_logits(out.chunks, seqs)
            return self._sample(sample_ids, logits, seqs)
        except Exception as exc:
            raise StepError(ids, exc) from exc

    def _forget(self, finished_ids: Sequence[str]) -> None:
        for rid in finished_ids:
            self._generators.pop(rid, None)
            self.kv_cache.drop_swapped(rid)

    def apply_swaps(self, out: SchedulerOutput) -> None:
        for rid, block_ids in out.swapped_out:
            self.kv_cache.swap_out(rid, block_ids)
        for rid, block_ids in out.swapped_in:
            self.kv_cache.swap_in(rid, block_ids)

    def build_batch(self, chunks: Sequence[ScheduledChunk], seqs: Mapping[str, SequenceView]) -> FlatBatch:
        """The flat batch of `chunks` (see the module docstring for the order)."""
        block_size = self.kv_cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        layouts: list[ChunkLayout] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for c in _flat_order(chunks):
            seq = _check_chunk(c, seqs.get(c.request_id), block_size)
            end = c.start + c.num_new_tokens
            layouts.append(ChunkLayout(len(tokens), c.num_new_tokens, c.start, seq.block_table))
            tokens.extend(seq.token_ids[c.start : end])
            positions.extend(range(c.start, end))
            if c.samples:
                sample_rows.append(len(tokens) - 1)
                sample_ids.append(c.request_id)
        if positions and max(positions) >= self.spec.max_model_len:
            raise ValueError(f"position {max(positions)} exceeds max_model_len {self.spec.max_model_len}")
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        meta = build_metadata(layouts, sample_rows, block_size=block_size, device=self.device)
        return FlatBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            sample_ids=tuple(sample_ids),
        )

    def compute_logits(
        self, chunks: Sequence[ScheduledChunk], seqs: Mapping[str, SequenceView]
    ) -> tuple[tuple[str, ...], torch.Tensor]:
        """(request id per row, float32 logits [rows, vocab]) for the sampling chunks; writes the chunks' KV."""
        batch = self.build_batch(chunks, seqs)
        logits = self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_cache)
        return batch.sample_ids, logits

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = torch.Generator(device="cpu").manual_seed(params.seed)
        return generator

    def _sample(self, sample_ids: Sequence[str], logits: torch.Tensor, seqs: Mapping[str, SequenceView]) -> StepResult:
        params = [seqs[rid].params for rid in sample_ids]
        generators = [self._generator(rid, p) for rid, p in zip(sample_ids, params, strict=True)]
        tokens = self.sampler.sample(logits, params, generators)
        finished: dict[str, FinishReason] = {}
        for rid, p, token in zip(sample_ids, params, tokens, strict=True):
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                finished[rid] = FinishReason.STOP
            elif len(seqs[rid].token_ids) + 1 >= self.spec.max_model_len:
                finished[rid] = FinishReason.LENGTH  # the sequence is as long as the model allows
        return StepResult(
            sampled_token_ids={rid: (t,) for rid, t in zip(sample_ids, tokens, strict=True)}, finished=finished
        )
