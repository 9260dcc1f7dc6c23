"""The engine as a server backend (`contbatch serve --backend engine`).

`make_server_backend` loads a checkpoint (the demo model without one) with `contbatch.engine.load`,
exactly as the offline engine does, and returns what `contbatch.server` asks of a backend: a
thread-safe tokenizer and chat template, a decoder for the loop's text streams, the scheduler
config sized to the runner's KV cache, and the model executor (`ModelExecutor`), which the
server's driver thread runs through the step loop.

No asyncio here: the server wraps this in its own threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from contbatch.core.config import SchedulerConfig
from contbatch.engine.executor import ModelExecutor
from contbatch.engine.load import DEFAULT_KV_CACHE_MEMORY, LoadedModel, fit_scheduler, load_model, warm_up
from contbatch.engine.prompt_bound import bytes_per_token, min_tokens
from contbatch.engine.tokenizer import Tokenizer

T = TypeVar("T")


class EngineBackend:
    name = "engine"

    def __init__(self, model: LoadedModel, config: SchedulerConfig, model_name: str) -> None:
        self.executor = ModelExecutor(model.runner)
        self.config = config
        self.model_name = model_name
        self.decoder: Tokenizer = model.tokenizer
        self.vocab_size = model.runner.spec.vocab_size
        self.bytes_per_token = bytes_per_token(model.tokenizer.backend)  # None: no untokenized bound

    def tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(self.decoder.encode(text))

    def min_prompt_tokens(self, text: str, *, stop_at: int | None = None) -> int:
        return min_tokens(text, self.bytes_per_token, stop_at=stop_at)  # bytes / the longest token's

    def chat_prompt_ids(self, messages: Sequence[Any]) -> tuple[int, ...]:
        """transformers' `apply_chat_template(..., tokenize=True, add_generation_prompt=True)`."""
        return tuple(self.decoder.chat_prompt_ids([{"role": m.role, "content": m.content} for m in messages]))

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_server_backend(
    config: SchedulerConfig,
    *,
    model: str | None,
    served_model_name: str | None,
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
    device: str | None = None,
    dtype: str | None = None,
) -> EngineBackend:
    """Load `model` (a local checkpoint directory; None: the demo model) and size the scheduler's
    KV config to the runner's cache (block count, block size) and its max model length.

    The load runs in a thread of its own that ends with it, so the OpenMP threads its tensor
    operations start end too. Left in the calling thread, they would make the server's process
    hold two OpenMP teams (the caller's and the driver thread's, which steps the engine): libgomp
    then counts more of its threads than CPUs and cuts every waiting thread's spin to about 100
    turns, so the driver's workers sleep and are woken between nearly every two operations of a
    step (some 100 context switches a step; steps 30-50 % slower on 2 cores).
    """
    block_size = config.kv.block_size if config.kv is not None else 16

    def load() -> tuple[LoadedModel, SchedulerConfig]:
        loaded = load_model(model, kv_cache_memory=kv_cache_memory, block_size=block_size, device=device, dtype=dtype)
        fitted = fit_scheduler(config, loaded.runner)
        warm_up(loaded.runner, fitted)
        return loaded, fitted

    loaded, fitted = in_passing_thread(load)
    return EngineBackend(loaded, fitted, served_model_name or loaded.path.name)


def in_passing_thread(call: Callable[[], T]) -> T:
    """`call()` in a new thread that ends when it returns; its result, or its exception raised here.
    A daemon thread: Ctrl-C in the caller's join ends the process without waiting for `call`."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller, which raises it
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="contbatch-load", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result
