"""The scheduler -> executor contract and the executor -> scheduler answer.

`SchedulerOutput` says what one step computes; `StepResult` says what came out of it. Both are
frozen: an executor (the simulator's cost model or the real engine) may read them, never change
them. Every field states its unit and invariant.

The output is self-sufficient, as vLLM's: an executor that applies every output in order, and
nothing else, knows each request it must compute, its token ids and its block table. It applies,
in this order: `finished_ids` (forget the request), `preempted_ids` (a request not also in
`swapped_out` lost its KV: forget it; it comes back in `new_requests`), `swapped_out` (copy
those blocks to host memory; the request keeps its tokens, its table is empty),
`new_requests` (start a request: its token ids and parameters), `swapped_in` (copy the host
copy into these device blocks), `block_deltas` (cut each table to `num_kept` blocks, then
append `added`: a new, resumed or swapped-in request gets its whole table this way), then it
computes `chunks`. A request's own sampled tokens are the executor's to keep: the scheduler
keeps every sampled token of a request that goes on running.

`AddDecision` is the scheduler's answer to `add_request`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from contbatch.core.status import FinishReason

_EMPTY: Mapping[str, object] = MappingProxyType({})
ExecutorParams = object  # compiled, a dataclass's field types are looked up in its module, not in builtins


@dataclass(frozen=True, slots=True)
class AddDecision:
    """What `add_request` did: queued (it waits for a step to admit it) or rejected at once.
    Admission into the running set happens only inside `schedule`. Truthy when queued."""

    queued: bool
    reject_kind: str = ""  # rejected only: max_model_len, kv_capacity, token_budget, tenant_quota, queue_full
    reason: str = ""  # rejected only: why, in words

    def __bool__(self) -> bool:
        return self.queued


QUEUED = AddDecision(queued=True)


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the executor must start: scheduled for the first time, or resumed after a
    preemption that dropped its KV (recompute). Its blocks come in the same output's
    `block_deltas`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]  # empty when the scheduler knows lengths only (the simulator)
    output_token_ids: tuple[int, ...]  # outputs sampled before a preemption; () on a first admission
    params: ExecutorParams  # the executor's per-request parameters, as given with the request


class BlockDelta(NamedTuple):
    """One request's device block table changed since the previous output: keep its first
    `num_kept` blocks (the rest were released), then append `added`, in token order."""

    request_id: str
    num_kept: int
    added: tuple[int, ...]


class ScheduledChunk(NamedTuple):
    """One request's share of a step: tokens [start, start + num_new_tokens) of its sequence."""

    request_id: str
    start: int  # num_computed_tokens before this step (the first position computed now)
    num_new_tokens: int  # >= 1
    is_prefill: bool  # computes prompt (or recomputed) positions; False: a decode at the sequence end
    samples: bool  # this step samples output token(s) for the request


new_chunk = tuple.__new__
"""``new_chunk(ScheduledChunk, (request_id, start, num_new_tokens, is_prefill, samples))``: the
same tuple as ``ScheduledChunk(...)`` without the named tuple's Python-level ``__new__``, which
compiled code would run as Python (the per-request hot paths use it)."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int  # 0, 1, 2, ... per scheduler
    chunks: tuple[ScheduledChunk, ...]  # distinct request ids, in execution order
    num_batched_tokens: int  # == sum(c.num_new_tokens for c in chunks) <= token budget
    num_prefill_tokens: int  # tokens of prefill chunks (prompt or recomputed positions)
    num_decode_tokens: int  # == num_batched_tokens - num_prefill_tokens
    num_context_tokens: int  # == sum(c.start + c.num_new_tokens): KV positions read by attention
    num_padding_tokens: int = 0  # token-work computed for no request (static padding, idle slots)
    preempted_ids: tuple[str, ...] = ()  # requests preempted by this schedule() call
    finished_ids: tuple[str, ...] = ()  # requests finished since the previous step; resources freed
    # (request id, device block ids) whose KV moves to host memory before this step (then freed)
    swapped_out: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # (request id, new device block ids) whose KV moves back from host memory before this step
    swapped_in: tuple[tuple[str, tuple[int, ...]], ...] = ()
    num_requests: int = 0  # == len(chunks) + num_omitted_decodes
    # steady decodes (one token each, sampling) left out of `chunks` but counted in every total:
    # a decode run's step shape (contbatch.sim.decode_run), priced without listing its requests
    num_omitted_decodes: int = 0
    new_requests: tuple[NewRequestData, ...] = ()  # requests the executor must start before this step
    block_deltas: tuple[BlockDelta, ...] = ()  # block tables changed since the previous output

    def __init__(  # noqa: PLR0917 (a dataclass's signature: its fields, in order)
        self,
        step_id: int,
        chunks: tuple[ScheduledChunk, ...],
        num_batched_tokens: int,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        num_context_tokens: int,
        num_padding_tokens: int = 0,
        preempted_ids: tuple[str, ...] = (),
        finished_ids: tuple[str, ...] = (),
        swapped_out: tuple[tuple[str, tuple[int, ...]], ...] = (),
        swapped_in: tuple[tuple[str, tuple[int, ...]], ...] = (),
        num_requests: int = 0,
        num_omitted_decodes: int = 0,
        new_requests: tuple[NewRequestData, ...] = (),
        block_deltas: tuple[BlockDelta, ...] = (),
    ) -> None:
        """The fields in order (`num_requests` recounted when there are chunks). Written out, not
        generated: compiled, the generated one runs as Python (see `contbatch.compiled`)."""
        object.__setattr__(self, "step_id", step_id)
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "num_batched_tokens", num_batched_tokens)
        object.__setattr__(self, "num_prefill_tokens", num_prefill_tokens)
        object.__setattr__(self, "num_decode_tokens", num_decode_tokens)
        object.__setattr__(self, "num_context_tokens", num_context_tokens)
        object.__setattr__(self, "num_padding_tokens", num_padding_tokens)
        object.__setattr__(self, "preempted_ids", preempted_ids)
        object.__setattr__(self, "finished_ids", finished_ids)
        object.__setattr__(self, "swapped_out", swapped_out)
        object.__setattr__(self, "swapped_in", swapped_in)
        object.__setattr__(self, "num_requests", len(chunks) + num_omitted_decodes if chunks else num_requests)
        object.__setattr__(self, "num_omitted_decodes", num_omitted_decodes)
        object.__setattr__(self, "new_requests", new_requests)
        object.__setattr__(self, "block_deltas", block_deltas)

    @property
    def num_swapped_blocks(self) -> int:
        """Blocks moved between device and host memory for this step (either direction)."""
        return sum(len(ids) for _, ids in self.swapped_out) + sum(len(ids) for _, ids in self.swapped_in)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.num_requests


def build_output(
    step_id: int,
    chunks: Iterable[ScheduledChunk],
    *,
    num_padding_tokens: int = 0,
    preempted_ids: tuple[str, ...] = (),
    finished_ids: tuple[str, ...] = (),
    swapped_out: tuple[tuple[str, tuple[int, ...]], ...] = (),
    swapped_in: tuple[tuple[str, tuple[int, ...]], ...] = (),
    new_requests: tuple[NewRequestData, ...] = (),
    block_deltas: tuple[BlockDelta, ...] = (),
) -> SchedulerOutput:
    """A `SchedulerOutput` whose totals are derived from `chunks` (so they cannot disagree)."""
    listed = tuple(chunks)
    batched = prefill = starts = 0
    for _, start, num_new, is_prefill, _ in listed:
        batched += num_new
        starts += start
        if is_prefill:
            prefill += num_new
    context = starts + batched
    return SchedulerOutput(
        step_id=step_id,
        chunks=listed,
        num_batched_tokens=batched,
        num_prefill_tokens=prefill,
        num_decode_tokens=batched - prefill,
        num_context_tokens=context,
        num_padding_tokens=num_padding_tokens,
        preempted_ids=preempted_ids,
        finished_ids=finished_ids,
        swapped_out=swapped_out,
        swapped_in=swapped_in,
        num_requests=len(listed),
        new_requests=new_requests,
        block_deltas=block_deltas,
    )


class TokenLogprobs(NamedTuple):
    """One token's log-probability under the model's raw distribution at its position (natural
    log, log-softmax of the logits before any sampling rule), its rank there (1 = the most
    likely) and the most likely (token id, log-probability) pairs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    # request id -> token ids sampled this step; keys == ids of the step's sampling chunks
    sampled_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # request id -> reason, for requests the executor ended (a stop token or string, an error)
    finished: Mapping[str, FinishReason] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        for name in ("sampled_token_ids", "finished"):
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(value)))

    # Log-probabilities, when a request asked for them: a `LogprobsResult` (the engine's) carries
    # them; a plain result (every simulator step) has none and pays nothing for them.
    @property
    def logprobs(self) -> Mapping[str, tuple[TokenLogprobs, ...]] | None:
        return None

    @property
    def prompt_logprobs(self) -> Mapping[str, tuple[TokenLogprobs | None, ...]] | None:
        return None


@dataclass(frozen=True, slots=True)
class LogprobsResult(StepResult):
    """A `StepResult` with log-probabilities. logprobs: request id -> one entry per token of
    sampled_token_ids[id], in order. prompt_logprobs: request id -> one entry per prompt token
    (None for the first), given once, in the step that samples the request's first token."""

    logprobs: Mapping[str, tuple[TokenLogprobs, ...]] | None = None
    prompt_logprobs: Mapping[str, tuple[TokenLogprobs | None, ...]] | None = None

    def __post_init__(self) -> None:
        StepResult.__post_init__(self)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(value)))
