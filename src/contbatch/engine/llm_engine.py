"""The engine loop: the core scheduler deciding what the real model computes, on a wall clock.

Each `step()` is the three calls of DESIGN.md section 2 with `time.monotonic()`::

    out = scheduler.schedule(now); result = runner.execute(out, seqs); scheduler.update(out, result, now)

The scheduler's KV manager hands out block ids; the runner's paged cache holds the data behind
them (sized together: the scheduler gets exactly the runner's block count and block size). The
engine keeps each request's prompt token ids and text stream (incremental detokenization and
stop strings); output token ids live in the core `Request`. A step whose execution fails ends
only the requests it touched, with finish reason `error`, and the engine keeps serving.

Invariants: every unfinished core request has an entry here and vice versa (dropped in the step
that reports it finished); `RequestOutput`s of one request arrive in order, the last with a
finish reason.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from contbatch.core import FinishReason, Request, SchedulerConfig, make_scheduler
from contbatch.core.config import KVConfig
from contbatch.core.outputs import SchedulerOutput
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.detokenizer import TextStream
from contbatch.engine.errors import StepError
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.engine.sampling import SamplingParams
from contbatch.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # a local checkpoint directory; None: the built-in demo model
    kv_cache_memory: int = 256 * 1024**2  # bytes of paged KV cache
    block_size: int = 16
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype on CUDA
    device: str | None = None  # None: cuda when present, else cpu
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(kv=KVConfig()))
    scheduler_kind: str = "continuous"  # or "static" (batch barrier; for comparisons)

    def __post_init__(self) -> None:
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output of this request
    token_ids: tuple[int, ...]  # new token ids since the previous output
    finish_reason: FinishReason | None  # set on the request's last output
    num_prompt_tokens: int
    num_output_tokens: int  # so far


@dataclass(slots=True)
class _Live:
    request: Request
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: TextStream
    num_reported: int = 0  # output tokens already turned into RequestOutputs


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, share: LLMEngine | None = None) -> None:
        """Load the model (or `share` another engine's model, cache and tokenizer: its KV data
        is only scratch between runs, the new scheduler hands the blocks out afresh)."""
        self.config = config = config or EngineConfig()
        if share is not None:
            self.model_path, self.runner, self.tokenizer = share.model_path, share.runner, share.tokenizer
        else:
            self.model_path = Path(config.model) if config.model is not None else ensure_demo_model()
            self.runner = ModelRunner.from_checkpoint(
                self.model_path,
                kv_memory_bytes=config.kv_cache_memory,
                block_size=config.block_size,
                device=config.device,
                dtype=config.dtype,
                seed=config.seed,
            )
            self.tokenizer = Tokenizer.from_dir(self.model_path)
        spec = self.runner.spec
        kv = config.scheduler.kv or KVConfig()
        kv = dataclasses.replace(kv, num_blocks=self.runner.kv_cache.num_blocks, block_size=config.block_size)
        limit = min(config.scheduler.max_model_len or spec.max_model_len, spec.max_model_len)
        self.scheduler = make_scheduler(
            config.scheduler_kind, dataclasses.replace(config.scheduler, kv=kv, max_model_len=limit)
        )
        self._live: dict[str, _Live] = {}
        self._next_id = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len or self.runner.spec.max_model_len

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        arrival_ts: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> Request:
        """Queue a request (text or token ids); its core `Request` is returned (finished at once,
        REJECTED with the reason, when it can never run). ValueError for an empty prompt or a
        duplicate id."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        request_id = request_id if request_id is not None else self._new_id()
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(token_ids))
        now = time.monotonic()
        request = Request(
            request_id, arrival_ts if arrival_ts is not None else now, len(token_ids), max_tokens,
            priority=priority, tenant=tenant,
        )  # fmt: skip
        stream = TextStream(self.tokenizer, token_ids, params.stop)
        self._live[request_id] = _Live(request, token_ids, params, stream)
        if not self.scheduler.add_request(request, now):
            del self._live[request_id]
        return request

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV blocks are freed in this call."""
        found = self.scheduler.cancel(request_id, time.monotonic())
        self._live.pop(request_id, None)
        return found

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _new_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and apply one step; the outputs it produced (text deltas, finishes)."""
        out = self.scheduler.schedule(time.monotonic())
        if out.is_empty:
            return []
        try:
            result = self.runner.execute(out, self._sequences(out))
        except StepError as exc:
            return self._fail(exc.request_ids, f"{type(exc.cause).__name__}: {exc.cause}")
        done = self.scheduler.update(out, result, time.monotonic())
        return self._outputs(out, {r.request_id for r in done})

    def _sequences(self, out: SchedulerOutput) -> dict[str, SequenceState]:
        kv = self.scheduler.memory.kv if self.scheduler.memory is not None else None
        seqs: dict[str, SequenceState] = {}
        for chunk in out.chunks:
            live = self._live[chunk.request_id]
            tokens = live.prompt_token_ids + live.request.output_token_ids
            table = kv.block_table(chunk.request_id) if kv is not None else ()
            seqs[chunk.request_id] = SequenceState(tokens, table, live.params)
        return seqs

    def _outputs(self, out: SchedulerOutput, done_ids: set[str]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for chunk in out.chunks:
            live = self._live.get(chunk.request_id)
            if live is None or not chunk.samples:
                continue
            request = live.request
            new_ids = tuple(request.output_token_ids[live.num_reported :])
            live.num_reported = len(request.output_token_ids)
            delta = live.stream.add(new_ids)
            reason = request.finish_reason
            if delta.stopped and reason is None:
                self.scheduler.cancel(request.request_id, now, FinishReason.STOP)
                reason = FinishReason.STOP
            text = delta.text + (live.stream.finish() if reason is not None and not delta.stopped else "")
            outputs.append(
                RequestOutput(
                    request.request_id, text, new_ids, reason, request.num_prompt_tokens, request.num_output_tokens
                )
            )
            if reason is not None:
                del self._live[request.request_id]
        for rid in done_ids - {o.request_id for o in outputs}:
            self._live.pop(rid, None)
        return outputs

    def _fail(self, request_ids: tuple[str, ...], message: str) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is not None and self.scheduler.cancel(rid, now, FinishReason.ERROR, detail=message):
                r = live.request
                outputs.append(RequestOutput(rid, "", (), FinishReason.ERROR, r.num_prompt_tokens, r.num_output_tokens))
        return outputs
