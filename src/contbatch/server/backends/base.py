"""What a server backend provides: a tokenizer, a chat template and a step executor.

A backend is chosen by name (`contbatch.server.backends.make_backend`). The HTTP layer calls
`tokenize` and `chat_prompt` from the asyncio thread (they must be pure and thread-safe); the
driver thread alone calls the executor (`contbatch.server.executor.Executor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from contbatch.core.config import SchedulerConfig
from contbatch.server.executor import Executor


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
    def vocab_size(self) -> int | None: ...  # token ids of a prompt given as ids must be below it

    def tokenize(self, text: str) -> tuple[int, ...]: ...

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str: ...

    def close(self) -> None: ...
