"""What the loop runs steps on: an `Executor` computes a `SchedulerOutput` into a `StepResult`.

The simulator's executor samples dummy tokens without a model; the paced simulator behind the
server also sleeps for the step's price; the engine's runs the model forward and sampling.

The contract (`contbatch.core.outputs` states the order): an executor is handed every output
that has anything for it, in step order, and needs nothing else. It applies the output's
bookkeeping (finished, preempted, swapped, new requests, block deltas), then computes its
chunks. An output with no chunks carries bookkeeping only: the executor computes nothing,
samples nothing and takes no time for it.

Failure: an executor that cannot compute a step raises; `StepError` names the requests the
failure concerns (any other exception concerns the whole step). The loop ends those requests
with finish reason ERROR and goes on serving the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from contbatch.core.outputs import SchedulerOutput, StepResult


class Executor(Protocol):
    def execute(self, out: SchedulerOutput) -> StepResult: ...


class StepError(RuntimeError):
    """A step failed for `request_ids` (the loop fails only those); `cause` is the original
    exception (also chained as `__cause__`)."""

    def __init__(self, request_ids: Iterable[str], cause: BaseException) -> None:
        self.request_ids: tuple[str, ...] = tuple(dict.fromkeys(request_ids))
        self.cause = cause
        super().__init__(f"step failed for requests {list(self.request_ids)}: {type(cause).__name__}: {cause}")


def has_bookkeeping(out: SchedulerOutput) -> bool:
    """Whether an output without chunks still carries something for the executor."""
    return bool(out.finished_ids or out.preempted_ids or out.swapped_out or out.block_deltas or out.new_requests)
