"""The offline engine: `LLMEngine` runs the real model on the one step loop
(`contbatch.loop.EngineCore`) with a wall clock and the model executor.

Each `step()` is one loop step with `time.monotonic()`; it returns the `RequestOutput`s the step
produced (text deltas, stop strings cut, finishes). Intake (tokenization, validation, prompt
block hashes for prefix caching), detokenization, stop strings and finishing are the loop's
(`contbatch.loop`); the model is loaded and the scheduler sized to its KV cache by
`contbatch.engine.load`, exactly as for the server. A step whose execution fails ends only the
requests it touched, with finish reason `error`, and the engine keeps serving.

Invariant: every request added gets exactly one final `RequestOutput` (a rejection at once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from contbatch.core import Request, SchedulerConfig, make_scheduler
from contbatch.core.config import KVConfig
from contbatch.engine.executor import ModelExecutor
from contbatch.engine.load import DEFAULT_KV_CACHE_MEMORY, LoadedModel, fit_scheduler, load_model, warm_up
from contbatch.engine.runner import ModelRunner
from contbatch.engine.tokenizer import Tokenizer
from contbatch.loop import EngineCore, Intake, RequestOutput, SamplingParams, StepObserver, TextStream, WallClock


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # a local checkpoint directory; None: the built-in demo model
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY  # bytes of paged KV cache
    block_size: int = 16
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype on CUDA
    device: str | None = None  # None: cuda when present, else cpu
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(kv=KVConfig()))
    scheduler_kind: str = "continuous"  # or "static" (batch barrier; for comparisons)

    def __post_init__(self) -> None:
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        share: LLMEngine | None = None,
        observers: list[StepObserver] | None = None,
    ) -> None:
        """Load the model (or `share` another engine's model, cache and tokenizer: its KV data
        is only scratch between runs, the new scheduler hands the blocks out afresh)."""
        self.config = config = config or EngineConfig()
        self.model: LoadedModel = (
            share.model
            if share is not None
            else load_model(
                config.model,
                kv_cache_memory=config.kv_cache_memory,
                block_size=config.block_size,
                device=config.device,
                dtype=config.dtype,
                seed=config.seed,
            )
        )
        runner = self.model.runner
        fitted = fit_scheduler(config.scheduler, runner)
        if share is None:
            warm_up(runner, fitted)
        self.scheduler = make_scheduler(config.scheduler_kind, fitted)
        kv = self.scheduler.config.kv
        self.intake = Intake(
            encode=self.tokenizer.encode,
            vocab_size=runner.spec.vocab_size,
            max_model_len=self.max_model_len,
            hash_block_size=kv.block_size if kv is not None and kv.enable_prefix_caching else None,
        )
        self.core = EngineCore(self.scheduler, ModelExecutor(runner), WallClock(), observers=observers or ())
        self._next_id = 0

    @property
    def runner(self) -> ModelRunner:
        return self.model.runner

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    @property
    def model_path(self) -> Path:
        return self.model.path

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
        REJECTED with the reason, when it can never run). ValueError for an empty or invalid
        prompt or an id in use."""
        params = params or SamplingParams()
        token_ids = self.intake.prompt_ids(prompt)
        request_id = request_id if request_id is not None else self._new_id()
        if self.core.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in the engine")
        arrival = arrival_ts if arrival_ts is not None else time.monotonic()
        request = self.intake.request(
            request_id, token_ids, params, arrival_ts=arrival, priority=priority, tenant=tenant
        )
        self.core.add_request(request, TextStream(self.tokenizer, token_ids, params.stop))
        return request

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV blocks are freed in this call."""
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def _new_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one loop step; the outputs produced since the previous call (text deltas,
        finishes, rejections)."""
        self.core.step()
        return self.core.take_outputs()
