"""`StepBuilder`: the step being assembled inside one `schedule()` call.

Owns the token budget and the chunks chosen so far (by request id, in execution order), plus
what the memory layer did (preemptions, swaps). Invariant: the budget's used tokens equal the
sum of the chunks' tokens; `unschedule` refunds exactly what `add` consumed.
"""

from __future__ import annotations

from functools import partial

from contbatch.core.budget import TokenBudget
from contbatch.core.outputs import BlockDelta, NewRequestData, ScheduledChunk, SchedulerOutput, build_output
from contbatch.core.request import Request

_as_block_delta = partial(tuple.__new__, BlockDelta)  # BlockDelta(*d) without its Python-level __new__


class StepBuilder:
    __slots__ = (
        "admitted_ids",
        "budget",
        "chunks",
        "grew_by_preempting",
        "new_requests",
        "num_new_partial_prefills",
        "preempted_ids",
        "requeue",
        "swapped_in",
        "swapped_out",
    )

    def __init__(self, token_budget: int) -> None:
        self.budget = TokenBudget(token_budget)
        self.chunks: dict[str, ScheduledChunk] = {}
        self.preempted_ids: list[str] = []
        self.swapped_out: list[tuple[str, tuple[int, ...]]] = []
        self.swapped_in: list[tuple[str, tuple[int, ...]]] = []
        self.num_new_partial_prefills = 0
        self.grew_by_preempting = False  # a running request took a victim's memory this step
        self.admitted_ids: set[str] = set()  # admitted this step: never preempted in the same step
        self.requeue: list[Request] = []  # preempted during admission: back to the queue afterwards
        self.new_requests: list[Request] = []  # admitted with no KV of their own yet: the executor starts them

    def add(self, chunk: ScheduledChunk) -> None:
        """Record `chunk`; its tokens were already taken from the budget by the caller's plan."""
        self.chunks[chunk.request_id] = chunk

    def unschedule(self, request_id: str) -> None:
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.budget.refund(chunk.num_new_tokens)

    def build(
        self,
        step_id: int,
        *,
        num_padding_tokens: int,
        finished_ids: tuple[str, ...],
        block_deltas: list[tuple[str, int, tuple[int, ...]]],
    ) -> SchedulerOutput:
        return build_output(
            step_id,
            self.chunks.values(),
            num_padding_tokens=num_padding_tokens,
            preempted_ids=tuple(self.preempted_ids),
            finished_ids=finished_ids,
            swapped_out=tuple(self.swapped_out),
            swapped_in=tuple(self.swapped_in),
            new_requests=tuple(new_request_data(r) for r in self.new_requests),
            block_deltas=tuple(map(_as_block_delta, block_deltas)),
        )


def new_request_data(request: Request) -> NewRequestData:
    """What an executor needs to start `request` (its outputs so far only when it has token ids)."""
    outputs = tuple(request.output_token_ids) if request.prompt_token_ids and request.num_output_tokens else ()
    return NewRequestData(request.request_id, request.prompt_token_ids, outputs, request.params)
