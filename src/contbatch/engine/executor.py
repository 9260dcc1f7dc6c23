"""`ModelExecutor`: the engine's executor for the step loop (`contbatch.loop.Executor`).

It needs nothing but the step outputs (the contract of `contbatch.core.outputs`): from them it
keeps, per request, its token ids (prompt, then every token it sampled) and its device block
table, and hands both to the `ModelRunner` with the request's `SamplingParams`. Appending a
sampled token is O(1): no step copies a request's history.

Invariants: after applying an output, every request of its chunks has a sequence here whose
block table equals the scheduler's and whose token ids are the request's known tokens (the
runner checks both per chunk); a request leaves when its id is finished or preempted without a
swap (a recompute brings it back as a new request).
"""

from __future__ import annotations

from dataclasses import dataclass

from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.engine.runner import ModelRunner
from contbatch.loop.executor import StepError
from contbatch.loop.params import GREEDY, SamplingParams


@dataclass(slots=True, eq=False)
class _Sequence:
    token_ids: list[int]
    block_table: list[int]
    params: SamplingParams


class ModelExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._seqs: dict[str, _Sequence] = {}

    @property
    def num_sequences(self) -> int:
        """Requests it holds state for (started and not finished or dropped)."""
        return len(self._seqs)

    def execute(self, out: SchedulerOutput) -> StepResult:
        try:
            self._apply(out)
        except Exception as exc:  # a broken output: the step's requests end, the rest go on
            raise StepError([c.request_id for c in out.chunks], exc) from exc
        result = self.runner.execute(out, self._seqs)
        seqs = self._seqs
        for rid, token_ids in result.sampled_token_ids.items():
            seq = seqs.get(rid)
            if seq is not None:
                seq.token_ids.extend(token_ids)
        return result

    def _apply(self, out: SchedulerOutput) -> None:
        seqs = self._seqs
        for rid in out.finished_ids:
            seqs.pop(rid, None)
        swapped = {rid for rid, _ in out.swapped_out}
        for rid in out.preempted_ids:
            if rid in swapped:
                seq = seqs.get(rid)
                if seq is not None:
                    seq.block_table.clear()  # its KV is on the host now
            else:
                seqs.pop(rid, None)  # recompute: it comes back as a new request
        for new in out.new_requests:
            params = new.params if isinstance(new.params, SamplingParams) else GREEDY
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            seqs[new.request_id] = _Sequence(tokens, [], params)
        for rid, num_kept, added in out.block_deltas:
            seq = seqs.get(rid)
            if seq is None:
                raise ValueError(f"step {out.step_id}: blocks for request {rid!r}, which this executor never started")
            del seq.block_table[num_kept:]
            seq.block_table.extend(added)
