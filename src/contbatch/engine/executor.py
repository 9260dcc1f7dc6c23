"""`ModelExecutor`: the engine's executor for the step loop (`contbatch.loop.Executor`).

It needs nothing but the step outputs (the contract of `contbatch.core.outputs`): from them it
keeps, per request, its token ids (prompt, then every token it sampled) and its device block
table, and hands both to the `ModelRunner` with the request's `SamplingParams`. Appending a
sampled token is O(1): no step copies a request's history.

Speculative decoding (`SchedulerConfig.num_speculative_tokens` k > 0): the scheduler plans a
decode chunk of 1 + k positions. For each one the executor proposes up to k draft tokens by
prompt lookup (`contbatch.engine.ngram`: the longest suffix n-gram, `prompt_lookup_min` to
`prompt_lookup_max` tokens, found earlier in the request's own prompt and output), appends them
to the sequence for the step only, and runs the chunk shortened to 1 + d positions when it found
d < k drafts (d = 0: a plain one-token decode). Drafts never go past `max_model_len`. The runner
verifies them in the one forward (accepted while the target's own token agrees, greedy or
sampled; see `contbatch.engine.runner`) and returns 1 to d + 1 tokens; the scheduler keeps the
KV of the accepted positions and rolls back the rest (and counts all k planned positions as
drafts in its stats, so shortened chunks show as rejected drafts).

Prompt log-probabilities (`SamplingParams.prompt_logprobs`): gathered over a request's prefill
chunks (chunked prefill included) and handed over whole in the step that samples its first
token. A request resumed after a recompute preemption with outputs already had them; one
preempted before its first token gathers them again. The prompt must be computed from position
0: the intake gives such requests no prefix-cache hashes.

Invariants: after applying an output, every request of its chunks has a sequence here whose
block table equals the scheduler's and whose token ids are the request's known tokens (the
runner checks both per chunk; drafts are there only during `execute`); a request leaves when its
id is finished or preempted without a swap (a recompute brings it back as a new request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contbatch.core.outputs import LogprobsResult, ScheduledChunk, SchedulerOutput, StepResult, TokenLogprobs
from contbatch.engine.ngram import pack, propose_ngram
from contbatch.engine.runner import ModelRunner
from contbatch.loop.executor import StepError
from contbatch.loop.params import GREEDY, SamplingParams

DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 4


@dataclass(slots=True, eq=False)
class _Sequence:
    token_ids: list[int]
    block_table: list[int]
    params: SamplingParams
    num_prompt_tokens: int
    # prompt log-probabilities gathered so far; None when not wanted or already handed over
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None)
    packed: bytearray | None = None  # the token ids for prompt lookup (`ngram.pack`), once it drafted


class ModelExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN,
        prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX,
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.runner = runner
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._seqs: dict[str, _Sequence] = {}
        self.num_proposed_tokens = 0  # draft tokens proposed (speculative chunks), whole run
        self.num_accepted_tokens = 0  # ... of which the target accepted

    @property
    def num_sequences(self) -> int:
        """Requests it holds state for (started and not finished or dropped)."""
        return len(self._seqs)

    def execute(self, out: SchedulerOutput) -> StepResult:
        try:
            self._apply(out)
        except StepError:
            raise
        except Exception as exc:  # a broken output: the step's requests end, the rest go on
            raise StepError([c.request_id for c in out.chunks], exc) from exc
        seqs = self._seqs
        gathering = [rid for rid, seq in seqs.items() if seq.prompt_logprobs is not None]
        drafted = self._draft(out.chunks)
        try:
            result = self.runner.execute(
                out, seqs, chunks=drafted[0] if drafted else None, prompt_logprob_ids=gathering
            )
        finally:
            if drafted:
                for rid, length in drafted[1].items():
                    del seqs[rid].token_ids[length:]
        if drafted:
            for rid, num_drafts in drafted[2].items():
                self.num_proposed_tokens += num_drafts
                self.num_accepted_tokens += min(len(result.sampled_token_ids.get(rid, ())) - 1, num_drafts)
        self._append(result)
        if result.prompt_logprobs:
            result = self._gather_prompt_logprobs(result)
        return result

    def _append(self, result: StepResult) -> None:
        seqs = self._seqs
        for rid, token_ids in result.sampled_token_ids.items():
            seq = seqs.get(rid)
            if seq is not None:
                seq.token_ids.extend(token_ids)
                if seq.packed is not None:
                    seq.packed += pack(token_ids)

    def _draft(
        self, chunks: tuple[ScheduledChunk, ...]
    ) -> tuple[list[ScheduledChunk], dict[str, int], dict[str, int]] | None:
        """For each speculative decode chunk: drafts appended to its sequence and the chunk cut to
        them. None when the step has no such chunk; else (the chunks to run, each drafted
        request's length before its drafts, its number of drafts)."""
        if not any(not c.is_prefill and c.num_new_tokens > 1 for c in chunks):
            return None
        max_len = self.runner.spec.max_model_len
        run: list[ScheduledChunk] = []
        lengths: dict[str, int] = {}
        counts: dict[str, int] = {}
        for c in chunks:
            if c.is_prefill or c.num_new_tokens == 1:
                run.append(c)
                continue
            seq = self._seqs.get(c.request_id)
            if seq is None:  # the runner reports it
                run.append(c)
                continue
            tokens = seq.token_ids
            if seq.packed is None:
                seq.packed = pack(tokens)
            k = min(c.num_new_tokens - 1, max_len - len(tokens))  # the last draft's position stays < max_model_len
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            drafts = propose_ngram(tokens, k, low, high, seq.packed) if k > 0 else []
            lengths[c.request_id] = len(tokens)
            counts[c.request_id] = len(drafts)
            tokens.extend(drafts)
            run.append(ScheduledChunk(c.request_id, c.start, 1 + len(drafts), c.is_prefill, c.samples))
        return run, lengths, counts

    def _gather_prompt_logprobs(self, result: StepResult) -> StepResult:
        """Add each chunk's prompt log-probabilities to its request's; hand over the whole list in
        the step that samples (none before)."""
        assert result.prompt_logprobs is not None
        ready: dict[str, tuple[TokenLogprobs | None, ...]] = {}
        for rid, part in result.prompt_logprobs.items():
            seq = self._seqs.get(rid)
            if seq is None or seq.prompt_logprobs is None:
                continue
            seq.prompt_logprobs.extend(part)
            if rid in result.sampled_token_ids:
                ready[rid] = tuple(seq.prompt_logprobs[: seq.num_prompt_tokens])
                seq.prompt_logprobs = None
        return LogprobsResult(
            sampled_token_ids=result.sampled_token_ids,
            finished=result.finished,
            logprobs=result.logprobs,
            prompt_logprobs=ready or None,
        )

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
            seq = _Sequence(tokens, [], params, len(new.prompt_token_ids))
            if params.prompt_logprobs is not None and not new.output_token_ids:
                seq.prompt_logprobs = []
            seqs[new.request_id] = seq
        for rid, num_kept, added in out.block_deltas:
            seq = seqs.get(rid)
            if seq is None:
                raise ValueError(f"step {out.step_id}: blocks for request {rid!r}, which this executor never started")
            del seq.block_table[num_kept:]
            seq.block_table.extend(added)
        self._check_prompt_starts(out)

    def _check_prompt_starts(self, out: SchedulerOutput) -> None:
        """A request gathering prompt log-probabilities must start its prompt at position 0."""
        for c in out.chunks:
            seq = self._seqs.get(c.request_id)
            if seq is not None and seq.prompt_logprobs == [] and c.is_prefill and c.start > 0:
                raise StepError(
                    [c.request_id],
                    ValueError(
                        f"request {c.request_id!r} asks for prompt logprobs, but its first {c.start} prompt tokens "
                        "were not computed (a prefix-cache hit)"
                    ),
                )
