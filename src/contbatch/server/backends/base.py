"""What a server backend provides: a tokenizer, a chat template, a decoder and a step executor.

A backend is chosen by name (`contbatch.server.backends.BACKENDS`). The HTTP layer calls
`tokenize` and `chat_prompt` from the asyncio thread (they must be pure and thread-safe); the
driver thread alone runs the step loop with the `executor` (`contbatch.loop.Executor`) and the
`decoder` (`contbatch.loop.text.Decoder`, for the requests' text streams), and calls `idle`
when the loop has nothing to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str: ...

    def idle(self) -> None: ...  # the loop is about to wait: nothing to run

    def close(self) -> None: ...
