"""The two protocols the step driver (`contbatch.server.driver`) runs on.

`Executor` computes steps: the paced simulator (`contbatch.server.backends.sim`) or the real
engine. `DriverObserver` receives what metrics need (`contbatch.server.metrics`). Both are called
only from the driver thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.core.request import Request
from contbatch.server.types import Submission


class Executor(Protocol):
    """What the driver runs steps on (the paced simulator, the real engine). Called only from the
    driver thread."""

    def add_request(self, submission: Submission) -> None:
        """A new request (its prompt ids and sampling parameters), before its first step."""

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Compute one step; may block for its duration."""
        ...

    def detokenize(self, request_id: str, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, the next output tokens of `request_id` (incremental)."""
        ...

    def release(self, request_id: str) -> None:
        """`request_id` finished: drop what is kept for it."""

    def idle(self) -> None:
        """The driver has nothing to run and is about to wait."""


class DriverObserver(Protocol):
    """Receives what metrics need; called on the driver thread."""

    def on_step(self, out: SchedulerOutput, duration_s: float, num_sampled: int) -> None: ...

    def on_finished(self, request: Request) -> None: ...
