"""Static batching: a batch is formed once and runs until every member finishes.

`schedule(now)` with no batch in flight takes up to `max_num_seqs` waiting requests in queue
order, and computes their prompts in one step, each padded to the longest (the padding is
token-work for no request). Every later step decodes one token for each unfinished member;
a finished member's slot stays in the batch, idle, and counts as one padding token per step
(the batch barrier). New arrivals wait for the whole batch to end. No token budget applies:
the executor's cost model prices the padded step, however large. With a KV budget each member
reserves its prompt plus output limit when the batch forms (a batch is as large as fits), so a
static batch never preempts.
"""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from contbatch.core.base import SchedulerBase
from contbatch.core.config import SchedulerConfig
from contbatch.core.outputs import BlockDelta, ScheduledChunk, SchedulerOutput, build_output
from contbatch.core.plan import plan_chunk
from contbatch.core.request import Request
from contbatch.core.step import new_request_data


@mypyc_attr(allow_interpreted_subclasses=True)  # an extension point (docs/extending.md)
class StaticScheduler(SchedulerBase):
    name = "static"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.batch: list[Request] = []  # members of the batch in flight, finished ones included

    def schedule(self, now: float) -> SchedulerOutput:
        self.expire_timeouts(now)
        new: list[Request] = []
        if not self.running:
            self.batch = new = self._form_batch(now)
            padding = self._prompt_padding()
        else:
            padding = len(self.batch) - len(self.running)  # idle slots of finished members
        chunks = [self._whole_chunk(r) for r in self.running]
        out = build_output(
            self._next_step_id(),
            chunks,
            num_padding_tokens=padding,
            finished_ids=self._take_finished_ids(),
            new_requests=tuple(new_request_data(r) for r in new),
            block_deltas=tuple(BlockDelta(*d) for d in self._take_block_deltas()),
        )
        self.last_output = out
        return out

    def _form_batch(self, now: float) -> list[Request]:
        batch: list[Request] = []
        for request in self.waiting.candidates(now):
            if len(batch) >= self._max_seqs or not self._reserve(request):
                break
            batch.append(request)
            self.waiting.admitted(request)
        self.waiting.remove(batch)
        for request in batch:
            request.admit(now)
        self.running = list(batch)
        return batch

    def _reserve(self, request: Request) -> bool:
        if self.memory is None:
            return True
        tokens = request.num_prompt_tokens + request.max_output_tokens
        return self.memory.reserve(request, tokens)

    def _prompt_padding(self) -> int:
        if not self.batch:
            return 0
        longest = max(r.num_prompt_tokens for r in self.batch)
        return sum(longest - r.num_prompt_tokens for r in self.batch)

    def _whole_chunk(self, request: Request) -> ScheduledChunk:
        chunk = plan_chunk(request, 1 << 62, sample_on_prefill=self.config.sample_on_prefill, allow_split=False)
        if chunk is None:  # a running, unfinished request always has work
            raise AssertionError(f"static batch member {request.request_id!r} has nothing to compute")
        return chunk
