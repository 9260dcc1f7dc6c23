"""What a server backend provides: a tokenizer, a chat template, a decoder and a step executor.

A backend is chosen by name (`contbatch.server.backends.BACKENDS`). The HTTP layer calls
`tokenize` and `chat_prompt_ids` from the asyncio thread or a worker thread (they must be pure and
thread-safe); the
driver thread alone runs the step loop with the `executor` (`contbatch.loop.Executor`) and the
`decoder` (`contbatch.loop.text.Decoder`, for the requests' text streams), and calls `idle`
when the loop has nothing to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from contbatch.core.config import SchedulerConfig
from contbatch.loop.executor import Executor
from contbatch.loop.text import Decoder


class BackendError(ValueError):
    """A backend cannot be built (a bad option, a missing package); the message says why."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system, developer, user, assistant or tool
    content: str  # the text parts joined


class Backend(Protocol):
    @property
    def name(self) -> str: ...  # "sim", "engine"

    @property
    def model_name(self) -> str: ...  # the id /v1/models lists and requests must name

    @property
    def config(self) -> SchedulerConfig: ...  # the scheduler config it runs with

    @property
    def executor(self) -> Executor: ...

    @property
    def decoder(self) -> Decoder: ...

    @property
    def vocab_size(self) -> int | None: ...  # token ids of a prompt given as ids must be below it

    def tokenize(self, text: str) -> tuple[int, ...]: ...

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]: ...  # the chat prompt's ids

    def idle(self) -> None: ...  # the loop is about to wait: nothing to run

    def close(self) -> None: ...


@runtime_checkable
class PromptBound(Protocol):
    """Optional for a backend: a lower bound on the tokens of a text, found without tokenizing it
    (cheap, thread-safe); it may stop counting once it reaches `stop_at`. The server refuses a
    prompt whose bound reaches max_model_len before tokenizing it (`contbatch.server.admission`)."""

    def min_prompt_tokens(self, text: str, *, stop_at: int | None = None) -> int: ...
