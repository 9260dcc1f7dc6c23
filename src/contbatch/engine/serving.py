"""The engine as a server backend (`contbatch serve --backend engine`).

`make_server_backend` loads a checkpoint (the demo model without one) into a `ModelRunner` and
returns what `contbatch.server` asks of a backend: a thread-safe tokenizer and chat template, the
scheduler config sized to the runner's KV cache, and an executor the server's driver thread
calls once per step. The driver owns the scheduler; it hands it to the executor (`bind`) so each
step can read the requests' output tokens and block tables.

No asyncio here: the server wraps this in its own threads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from contbatch.core.base import SchedulerBase
from contbatch.core.config import KVConfig, SchedulerConfig
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.engine.demo import ensure_demo_model
from contbatch.engine.detokenizer import IncrementalDetokenizer
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.engine.sampling import SamplingParams
from contbatch.engine.tokenizer import Tokenizer

DEFAULT_KV_CACHE_MEMORY = 256 * 1024**2


class _Submission(Protocol):  # contbatch.server.types.Submission, by shape (the engine never imports the server)
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: Any


@dataclass(slots=True)
class _State:
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer


class EngineExecutor:
    """Runs the steps the server's driver schedules on the real model."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self._scheduler: SchedulerBase | None = None
        self._states: dict[str, _State] = {}

    def bind(self, scheduler: SchedulerBase) -> None:
        self._scheduler = scheduler

    def add_request(self, submission: _Submission) -> None:
        p = submission.params
        params = SamplingParams(
            temperature=p.temperature, top_p=p.top_p, seed=p.seed, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos
        )
        prompt = list(submission.prompt_token_ids)
        self._states[submission.request_id] = _State(prompt, params, IncrementalDetokenizer(self.tokenizer, prompt))

    def execute(self, out: SchedulerOutput) -> StepResult:
        if self._scheduler is None or self._scheduler.memory is None:
            raise RuntimeError("the engine executor runs only with a scheduler with a KV cache bound to it")
        return self.runner.execute(out, self._sequences(out, self._scheduler))

    def _sequences(self, out: SchedulerOutput, scheduler: SchedulerBase) -> Mapping[str, SequenceState]:
        assert scheduler.memory is not None
        kv = scheduler.memory.kv
        seqs = {}
        for chunk in out.chunks:
            state = self._states[chunk.request_id]
            request = scheduler.requests[chunk.request_id]
            tokens = state.prompt_token_ids + request.output_token_ids
            seqs[chunk.request_id] = SequenceState(tokens, kv.block_table(chunk.request_id), state.params)
        return seqs

    def detokenize(self, request_id: str, token_ids: Sequence[int]) -> str:
        return self._states[request_id].detokenizer.add(token_ids)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def idle(self) -> None:
        pass


class EngineBackend:
    name = "engine"

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: SchedulerConfig, model_name: str) -> None:
        self.executor = EngineExecutor(runner, tokenizer)
        self.config = config
        self.model_name = model_name
        self._tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.executor.runner.spec.vocab_size

    def tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text))

    def chat_prompt(self, messages: Sequence[Any]) -> str:
        rendered = self._tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
        return str(rendered)

    def close(self) -> None:
        pass


def make_server_backend(
    config: SchedulerConfig,
    *,
    model: str | None,
    served_model_name: str | None,
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
) -> EngineBackend:
    """Load `model` (a local checkpoint directory; None: the demo model) and size the scheduler's
    KV config to the runner's cache (block count, block size) and its max model length."""
    path = Path(model) if model else ensure_demo_model()
    block_size = (config.kv or KVConfig()).block_size
    runner = ModelRunner.from_checkpoint(path, kv_memory_bytes=kv_cache_memory, block_size=block_size)
    kv = dataclasses.replace(config.kv or KVConfig(), num_blocks=runner.kv_cache.num_blocks)
    limit = min(config.max_model_len or runner.spec.max_model_len, runner.spec.max_model_len)
    sized = dataclasses.replace(config, kv=kv, max_model_len=limit)
    return EngineBackend(runner, Tokenizer.from_dir(path), sized, served_model_name or path.name)
