"""`ModelRunner`: executes one `SchedulerOutput` on the real model and answers a `StepResult`.

Per step, in order:
1. forget requests in `finished_ids` (their generators, any host copy of their KV);
2. apply `swapped_out` then `swapped_in` (swapped-out blocks may be reused in the same step);
3. build the flat batch: single-token chunks first, sorted by context length (so the paged
   attention pads decodes little), then multi-token chunks in schedule order; positions, slots
   from each request's block table;
4. one forward; logits for the rows that need them (below);
5. sample each sampling chunk with its request's `SamplingParams` (`contbatch.engine.sampling`);
   a sampled EOS (unless `ignore_eos`) or stop token id finishes the request with STOP, reaching
   `max_model_len` tokens with LENGTH. Stop strings are the engine loop's job; `max_tokens` is
   the scheduler's.

Logits rows, per chunk:
- a sampling chunk: its last token's row;
- a verification chunk (a decode chunk of 1 + d tokens, `is_prefill` False: the newest token
  followed by d draft tokens, which the caller put at the end of the sequence's token ids): one
  row per token. Row i is sampled as a plain decode would be, with the drafts before it as
  history; draft i + 1 is accepted when it equals the token row i gives, and verification stops
  at the first token that differs (that token is kept) or after the last row (a bonus token).
  Greedy requests are therefore token-exact with non-speculative decoding; random ones draw
  exactly the tokens plain decoding would (one draw per output token, from the same
  generator), so a seeded request's output does not depend on speculation either. The step
  returns 1 to d + 1 tokens; the scheduler keeps the KV of the accepted positions and rolls
  back the rest;
- a prefill chunk of a request in `prompt_logprob_ids`: one row per token, for the prompt
  log-probabilities (`StepResult.prompt_logprobs` holds this chunk's part: a None for the first
  prompt token when the chunk starts at 0, then one entry per prompt token it predicts).
Requests with `logprobs` get one entry per returned token (`StepResult.logprobs`); all
log-probabilities are the raw model distribution's (`sampling.logprobs_of`).

A step that reads nothing of its logits but each row's argmax (every row one sampling chunk's,
greedy, unadjusted, without log-probabilities: `_reads_argmax_only`) asks the model for the argmax
alone where it can give it (`argmax_only_head`: the LM head in bfloat16, exactly float32's tokens,
`contbatch.engine.argmax_head`), and takes each chunk's token without the sampler.

Any exception in a step is raised as `StepError` carrying the ids of the step's requests, except
a failure in sampling: then each sampling chunk is prepared and drawn again alone (with a
throwaway generator) and the `StepError` names only the requests whose own rows fail, when any
does (a poison request: its parameters break the sampler); the rest of the step is redone in the
next one, their generators as they were before the failed step (a seeded request draws the same
tokens as without the failure). When no request fails alone, the whole step's requests fail.

On CUDA, `execute` returns only once the step's kernels and copies have finished (a step that
samples nothing would otherwise return right after queueing them), so a host clock read around it
(the loop's wall clock, calibration's step timing) measures the step itself.

Invariants checked per chunk: the request has a `SequenceState`; its token ids cover the chunk;
its block table covers `start + num_new_tokens`; a sampling chunk ends at the last known token.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from contbatch.core.outputs import LogprobsResult, ScheduledChunk, SchedulerOutput, StepResult, TokenLogprobs
from contbatch.core.status import FinishReason
from contbatch.engine.attention import AttentionMetadata, ChunkLayout, build_metadata
from contbatch.engine.device import resolve_device, synchronize
from contbatch.engine.kv_cache import PagedKVCache, num_blocks_for_memory
from contbatch.engine.loader import load_checkpoint
from contbatch.engine.model import LlamaModel, resolve_dtype
from contbatch.engine.sampling import History, Prepared, Sampler, logprobs_of, reads_known_argmax
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

    @property
    def num_prompt_tokens(self) -> int: ...  # token_ids[:num_prompt_tokens] is the prompt


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A `SequenceView` as a value (tests, calibration grids). `num_prompt_tokens` (0: not given)
    matters for penalties, prompt log-probabilities and dynamic NTK RoPE past the model's
    positions."""

    token_ids: Sequence[int]
    block_table: Sequence[int]
    params: SamplingParams = GREEDY
    num_prompt_tokens: int = 0


class RowSpan(NamedTuple):
    """Consecutive logits rows of one chunk: rows [row, row + num_rows) are its positions
    [position, position + num_rows)."""

    chunk: ScheduledChunk
    row: int
    num_rows: int
    position: int
    verify: bool  # a verification chunk (drafts after the newest token)
    prompt_logprobs: bool  # its rows also give prompt log-probabilities


@dataclass(frozen=True, slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    sample_ids: tuple[str, ...]  # request id of each logits row, in row order
    spans: tuple[RowSpan, ...] = ()  # the chunks that have rows, in row order


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


def _is_verify(chunk: ScheduledChunk) -> bool:
    return not chunk.is_prefill and chunk.num_new_tokens > 1


class _Rows:
    """The rows whose log-probabilities a step reports (one `logprobs_of` call)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.tokens: list[int] = []
        self.num_top: list[int] = []

    def add(self, row: int, token: int, num_top: int) -> None:
        self.rows.append(row)
        self.tokens.append(token)
        self.num_top.append(num_top)

    def compute(self, logits: torch.Tensor, slice_rows: int = 512) -> list[TokenLogprobs]:
        """In slices of `slice_rows` rows, so a long prompt's log-softmax never copies every row at once."""
        out: list[TokenLogprobs] = []
        for begin in range(0, len(self.rows), slice_rows):
            end = begin + slice_rows
            index = torch.tensor(self.rows[begin:end], dtype=torch.long, device=logits.device)
            out.extend(logprobs_of(logits.index_select(0, index), self.tokens[begin:end], self.num_top[begin:end]))
        return out


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
        dev = resolve_device(device)
        kv_dtype = resolve_dtype(dtype if dtype is not None or dev.type == "cpu" else spec.dtype, dev)
        if kv_memory_bytes is not None:
            num_blocks = num_blocks_for_memory(spec, kv_memory_bytes, block_size, kv_dtype)
        kv = PagedKVCache(spec, num_blocks or 0, block_size, dtype=kv_dtype, device=dev)
        return cls(spec, weights, kv, seed=seed)

    # -- one step ------------------------------------------------------------------------------

    def execute(
        self,
        out: SchedulerOutput,
        seqs: Mapping[str, SequenceView],
        *,
        chunks: Sequence[ScheduledChunk] | None = None,
        prompt_logprob_ids: Collection[str] = (),
    ) -> StepResult:
        """Run one step (see the module docstring); raises `StepError` naming the step's requests.
        `chunks` replaces `out.chunks` (a verification chunk shortened to the drafts found);
        `prompt_logprob_ids`: requests whose prefill chunks report prompt log-probabilities."""
        run = out.chunks if chunks is None else chunks
        ids = [c.request_id for c in run]
        ids += [rid for rid, _ in out.swapped_out] + [rid for rid, _ in out.swapped_in]
        try:
            self._forget(out.finished_ids)
            self.apply_swaps(out)
            result = StepResult()
            if run:
                batch = self.build_batch(run, seqs, prompt_logprob_ids)
                greedy = None  # each row's argmax, found by the LM head's product where it can and is read
                rows = batch.sample_ids  # (the params read only where the head can find the argmax)
                if self.model.argmax_only_head and rows and self._reads_argmax_only(batch, seqs):
                    greedy = torch.empty(len(rows), dtype=torch.long)
                    self.compute_logits(run, seqs, batch=batch, greedy_out=greedy, argmax_only=True)
                    result = self._take_argmax(batch, seqs, greedy.tolist())
                else:
                    if self.model.greedy_in_head and rows and reads_known_argmax([seqs[r].params for r in rows]):
                        greedy = torch.empty(len(rows), dtype=torch.long)
                    _, logits = self.compute_logits(run, seqs, batch=batch, greedy_out=greedy)
                    result = self._sample(batch, logits, seqs, greedy)
            synchronize(self.device)  # a step that samples nothing (a prefill chunk, a swap) still queued work
            return result
        except StepError:
            raise  # a sampling failure of some requests only
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

    def build_batch(
        self,
        chunks: Sequence[ScheduledChunk],
        seqs: Mapping[str, SequenceView],
        prompt_logprob_ids: Collection[str] = (),
    ) -> FlatBatch:
        """The flat batch of `chunks` (see the module docstring for the order and the rows)."""
        block_size = self.kv_cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        layouts: list[ChunkLayout] = []
        rows: list[int] = []
        row_ids: list[str] = []
        spans: list[RowSpan] = []
        for c in _flat_order(chunks):
            seq = _check_chunk(c, seqs.get(c.request_id), block_size)
            end = c.start + c.num_new_tokens
            layouts.append(ChunkLayout(len(tokens), c.num_new_tokens, c.start, seq.block_table, seq.num_prompt_tokens))
            begin = len(tokens)
            tokens.extend(seq.token_ids[c.start : end])
            positions.extend(range(c.start, end))
            verify = _is_verify(c)
            prompt = c.is_prefill and c.request_id in prompt_logprob_ids and c.start < seq.num_prompt_tokens
            if verify or prompt:
                spans.append(RowSpan(c, len(rows), c.num_new_tokens, c.start, verify, prompt))
                rows.extend(range(begin, len(tokens)))
                row_ids.extend([c.request_id] * c.num_new_tokens)
            elif c.samples:
                spans.append(RowSpan(c, len(rows), 1, end - 1, False, False))
                rows.append(len(tokens) - 1)
                row_ids.append(c.request_id)
        if positions and max(positions) >= self.spec.max_model_len:
            raise ValueError(f"position {max(positions)} exceeds max_model_len {self.spec.max_model_len}")
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        meta = build_metadata(layouts, rows, block_size=block_size, device=self.device)
        return FlatBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            sample_ids=tuple(row_ids),
            spans=tuple(spans),
        )

    def compute_logits(
        self,
        chunks: Sequence[ScheduledChunk],
        seqs: Mapping[str, SequenceView],
        *,
        batch: FlatBatch | None = None,
        greedy_out: torch.Tensor | None = None,
        argmax_only: bool = False,
    ) -> tuple[tuple[str, ...], torch.Tensor]:
        """(request id per row, float32 logits [rows, vocab]) for the chunks' rows (one per
        sampling chunk, one per token of a verification chunk); writes the chunks' KV. `batch`:
        the chunks' flat batch, when already built; `greedy_out`, `argmax_only`: see `LlamaModel.forward`."""
        batch = batch if batch is not None else self.build_batch(chunks, seqs)
        ids, positions, meta = batch.input_ids, batch.positions, batch.meta
        logits = self.model.forward(ids, positions, meta, self.kv_cache, greedy_out=greedy_out, argmax_only=argmax_only)
        return batch.sample_ids, logits

    @staticmethod
    def _reads_argmax_only(batch: FlatBatch, seqs: Mapping[str, SequenceView]) -> bool:
        """Whether the step reads nothing of its logits but each row's argmax: every row is a
        sampling chunk's one row (no drafts to verify, no prompt log-probabilities), greedy, its
        logits unadjusted, without log-probabilities."""
        for span in batch.spans:
            p = seqs[span.chunk.request_id].params
            one_row = span.chunk.samples and span.num_rows == 1 and not span.verify and not span.prompt_logprobs
            if not (one_row and p.greedy and not p.adjusts_logits and p.logprobs is None):
                return False
        return True

    def _take_argmax(self, batch: FlatBatch, seqs: Mapping[str, SequenceView], tokens: list[int]) -> StepResult:
        """The step's result when each row's token is its argmax (`_reads_argmax_only`), as
        `_sample` would give it: each chunk's token, cut at a stop or the model's length."""
        sampled: dict[str, tuple[int, ...]] = {span.chunk.request_id: (tokens[span.row],) for span in batch.spans}
        return StepResult(sampled_token_ids=sampled, finished=self._finish_all(batch.spans, seqs, sampled))

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = torch.Generator(device="cpu").manual_seed(params.seed)
        return generator

    # -- sampling --------------------------------------------------------------------------------

    def _sample(
        self,
        batch: FlatBatch,
        logits: torch.Tensor,
        seqs: Mapping[str, SequenceView],
        greedy: torch.Tensor | None = None,
    ) -> StepResult:
        """Sample every sampling chunk, verify drafts, finish, and gather log-probabilities.
        `greedy`: each logits row's argmax, when the forward found it."""
        sampling = [s for s in batch.spans if s.chunk.samples]
        sampled: dict[str, tuple[int, ...]] = {}
        finished: dict[str, FinishReason] = {}
        if sampling:
            saved = self._save_generators(sampling, seqs)
            try:
                sampled, finished = self._sample_spans(sampling, logits, seqs, greedy)
            except Exception as exc:
                self._restore_generators(sampling, saved)
                failing = self._failing_alone(sampling, logits, seqs)
                if failing:
                    raise StepError(failing, exc) from exc
                raise
        logprobs, prompt_logprobs = self._logprobs(batch, logits, seqs, sampled)
        if logprobs is None and prompt_logprobs is None:
            return StepResult(sampled_token_ids=sampled, finished=finished)
        return LogprobsResult(
            sampled_token_ids=sampled, finished=finished, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )

    def _sample_spans(
        self,
        sampling: Sequence[RowSpan],
        logits: torch.Tensor,
        seqs: Mapping[str, SequenceView],
        greedy: torch.Tensor | None = None,
    ) -> tuple[dict[str, tuple[int, ...]], dict[str, FinishReason]]:
        """The tokens of every sampling chunk (drafts verified), and the requests they finish."""
        sampled: dict[str, tuple[int, ...]] = {}
        prepared, at = self._prepare(sampling, logits, seqs, greedy)
        # Plain sampling chunks draw together; verification chunks draw row by row.
        plain = [s for s in sampling if not s.verify]
        if plain:
            rows = [at[s.row + s.num_rows - 1] for s in plain]
            gens = [self._generator(s.chunk.request_id, seqs[s.chunk.request_id].params) for s in plain]
            for span, token in zip(plain, prepared.draw(rows, gens), strict=True):
                sampled[span.chunk.request_id] = (token,)
        for span in sampling:
            if span.verify:
                rid = span.chunk.request_id
                sampled[rid] = self._verify(span, seqs[rid], prepared, at)
        return sampled, self._finish_all(sampling, seqs, sampled)

    def _finish_all(
        self, spans: Sequence[RowSpan], seqs: Mapping[str, SequenceView], sampled: dict[str, tuple[int, ...]]
    ) -> dict[str, FinishReason]:
        """Each span's tokens in `sampled` cut at a stop or the model's length (`_finish`), in place;
        the requests they finish."""
        finished: dict[str, FinishReason] = {}
        for span in spans:
            rid = span.chunk.request_id
            sampled[rid], reason = self._finish(span, seqs[rid], sampled[rid])
            if reason is not None:
                finished[rid] = reason
        return finished

    def _save_generators(
        self, sampling: Sequence[RowSpan], seqs: Mapping[str, SequenceView]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The states of the generators the step's random rows draw from (None: every row is greedy)."""
        random = [s.chunk.request_id for s in sampling if not seqs[s.chunk.request_id].params.greedy]
        if not random:
            return None
        own = {rid: g.get_state() for rid in random if (g := self._generators.get(rid)) is not None}
        return self.sampler.shared.get_state(), own

    def _restore_generators(
        self, sampling: Sequence[RowSpan], saved: tuple[torch.Tensor, dict[str, torch.Tensor]] | None
    ) -> None:
        """Undo the draws of a failed sampling: the redone step draws what it would have drawn."""
        if saved is None:
            return
        shared, own = saved
        self.sampler.shared.set_state(shared)
        for span in sampling:
            rid = span.chunk.request_id
            if rid in own:
                self._generators[rid].set_state(own[rid])
            else:
                self._generators.pop(rid, None)  # made in the failed step: made again, from its seed

    def _failing_alone(
        self, sampling: Sequence[RowSpan], logits: torch.Tensor, seqs: Mapping[str, SequenceView]
    ) -> list[str]:
        """The requests whose sampling fails on its own: each sampling chunk prepared and drawn
        alone, from a throwaway generator (no request's generator moves)."""
        failing = []
        for span in sampling:
            try:
                prepared, at = self._prepare([span], logits, seqs)
                spare = torch.Generator(device="cpu").manual_seed(0)
                prepared.draw(list(at.values()), [spare] * len(at))
            except Exception:
                failing.append(span.chunk.request_id)
        return failing

    def _prepare(
        self,
        sampling: Sequence[RowSpan],
        logits: torch.Tensor,
        seqs: Mapping[str, SequenceView],
        greedy: torch.Tensor | None = None,
    ) -> tuple[Prepared, dict[int, int]]:
        """The sampler's distributions of the rows that sample (each with its params and, for
        penalties, its history), and each such row's index among them; `greedy`: each logits
        row's argmax, when known."""
        sample_rows: list[int] = []
        row_params: list[SamplingParams] = []
        histories: list[History] = []
        any_history = False
        for span in sampling:
            seq = seqs[span.chunk.request_id]
            first = 0 if span.verify else span.num_rows - 1  # a prompt span samples from its last row
            p = seq.params
            any_history |= p.has_penalties
            for i in range(first, span.num_rows):
                sample_rows.append(span.row + i)
                row_params.append(p)
                if p.has_penalties:
                    n = seq.num_prompt_tokens
                    end = span.position + i + 1  # the tokens before the one this row predicts
                    histories.append(History(seq.token_ids[:n], seq.token_ids[n:end]))
                else:
                    histories.append(_EMPTY_HISTORY)
        if len(sample_rows) == logits.shape[0]:
            sample_logits = logits  # every row samples (the common decode step)
        else:
            index = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
            sample_logits = logits.index_select(0, index)
            greedy = None if greedy is None else greedy.index_select(0, index.to(greedy.device))
        prepared = self.sampler.prepare(sample_logits, row_params, histories if any_history else (), greedy=greedy)
        return prepared, {row: j for j, row in enumerate(sample_rows)}

    def _verify(self, span: RowSpan, seq: SequenceView, prepared: Prepared, at: Mapping[int, int]) -> tuple[int, ...]:
        """The tokens a verification chunk keeps: accepted drafts, then the first differing token
        (or the bonus token after the last draft)."""
        drafts = seq.token_ids[span.position + 1 : span.position + span.num_rows]
        generator = self._generator(span.chunk.request_id, seq.params)
        stops = self._stop_ids(seq.params)
        out: list[int] = []
        for i in range(span.num_rows):
            token = prepared.draw([at[span.row + i]], [generator])[0]
            out.append(token)
            if i == len(drafts) or token != drafts[i] or token in stops:
                break
        return tuple(out)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int] | tuple[int, ...]:
        if params.ignore_eos:
            return params.stop_token_ids
        return self.eos_token_ids.union(params.stop_token_ids) if params.stop_token_ids else self.eos_token_ids

    def _finish(
        self, span: RowSpan, seq: SequenceView, tokens: tuple[int, ...]
    ) -> tuple[tuple[int, ...], FinishReason | None]:
        """`tokens` cut after the first stop token (STOP) or at `max_model_len` (LENGTH)."""
        p = seq.params
        stops = self._stop_ids(p)
        for i, token in enumerate(tokens):
            if token in stops:
                return tokens[: i + 1], FinishReason.STOP
        before = span.position + 1 if span.verify else len(seq.token_ids)  # known tokens before this step's
        room = max(self.spec.max_model_len - before, 1)
        if len(tokens) >= room:
            return tokens[:room], FinishReason.LENGTH  # the sequence is as long as the model allows
        return tokens, None

    def _logprobs(
        self,
        batch: FlatBatch,
        logits: torch.Tensor,
        seqs: Mapping[str, SequenceView],
        sampled: Mapping[str, tuple[int, ...]],
    ) -> tuple[dict[str, tuple[TokenLogprobs, ...]] | None, dict[str, tuple[TokenLogprobs | None, ...]] | None]:
        """Log-probabilities of the sampled tokens (requests with `logprobs`) and of the prompt
        tokens a prompt span predicts."""
        wanted = _Rows()
        prompt_spans: list[tuple[str, int, bool]] = []  # (request id, number of entries, starts with None)
        for span in batch.spans:
            rid = span.chunk.request_id
            seq = seqs[rid]
            if span.prompt_logprobs:
                k = seq.params.prompt_logprobs or 0
                # the chunk's positions that predict a prompt token
                last = min(span.position + span.num_rows, seq.num_prompt_tokens - 1)
                for pos in range(span.position, last):
                    wanted.add(span.row + pos - span.position, seq.token_ids[pos + 1], k)
                prompt_spans.append((rid, max(last - span.position, 0), span.position == 0))
            if span.chunk.samples and seq.params.logprobs is not None:
                tokens = sampled[rid]
                first = 0 if span.verify else span.num_rows - 1
                for i, token in enumerate(tokens):
                    wanted.add(span.row + first + i, token, seq.params.logprobs)
        if not wanted.rows and not prompt_spans:
            return None, None
        entries = iter(wanted.compute(logits))
        prompt: dict[str, tuple[TokenLogprobs | None, ...]] = {}
        sample: dict[str, tuple[TokenLogprobs, ...]] = {}
        for span in batch.spans:  # the same order as above
            rid = span.chunk.request_id
            if span.prompt_logprobs:
                _, count, leading = next(p for p in prompt_spans if p[0] == rid)
                got: list[TokenLogprobs | None] = [None] if leading else []
                got.extend(next(entries) for _ in range(count))
                prompt[rid] = tuple(got)
            if span.chunk.samples and seqs[rid].params.logprobs is not None:
                sample[rid] = tuple(next(entries) for _ in range(len(sampled[rid])))
        return (sample or None), (prompt or None)


_EMPTY_HISTORY = History((), ())
