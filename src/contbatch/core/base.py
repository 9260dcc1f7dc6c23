"""What every scheduler shares: the request registry, admission checks, `update`, `cancel`.

A subclass supplies `schedule(now)`. Invariants kept here:
- `requests` holds exactly the unfinished requests; each is in `waiting` or in `running`, never
  both; a request leaves `requests` in the same call that finishes it, and its KV blocks are
  released in that call;
- `update` applies a step's result only to requests still running (one cancelled while its
  step ran keeps its timeline; its tokens from that step are dropped, counted as unsent);
- a request finishes once, with one reason, and its id is reported in the next output's
  `finished_ids` so the executor frees what it holds for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from mypy_extensions import mypyc_attr

from contbatch.core.config import SchedulerConfig
from contbatch.core.lifecycle import may_run, next_timer, timeout_reason
from contbatch.core.memory import Memory
from contbatch.core.outputs import QUEUED, AddDecision, ScheduledChunk, SchedulerOutput, StepResult
from contbatch.core.queue import make_queue
from contbatch.core.request import Request
from contbatch.core.stats import SchedulerStats
from contbatch.core.status import FinishReason, RequestStatus


@mypyc_attr(allow_interpreted_subclasses=True)  # an extension point (docs/extending.md)
class SchedulerBase:  # not an ABC: compiled, ABCs share one isinstance cache (contbatch.compiled)
    name = "base"

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(
            config.queue_order, aging_rate=config.aging_rate, tenant_weights=config.tenants.weight_map
        )
        self.running: list[Request] = []
        self.last_output: SchedulerOutput | None = None
        self.num_finished = 0
        self.stats = SchedulerStats()
        self.memory = Memory(config.kv, self.stats) if config.kv is not None else None
        self._step_id = 0
        self._finished_since_output: list[str] = []
        self._max_seqs = config.max_num_seqs if config.max_num_seqs is not None else 1 << 62

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0.0 without a memory limit)."""
        return self.memory.kv.usage if self.memory is not None else 0.0

    # -- the three calls ---------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        raise NotImplementedError(f"{type(self).__name__} must define schedule(now)")

    def update(self, out: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Apply a step's result at `now` (the step's end); return the requests it finished.

        O(1) per chunk. A steady decode (one token sampled at the sequence end, with no block
        caching or service charge to keep) that got one token is `_apply_chunk`'s case inlined:
        the hot path, run for nearly every running request every step. It needs no cut at the
        output limit: a running request has room for one more token (this call finishes a
        request the moment it is full)."""
        done: list[Request] = []
        requests = self.requests
        sampled = result.sampled_token_ids
        running = RequestStatus.RUNNING
        # block caching and service charges, checked once per step rather than per chunk
        plain = not self.waiting.charges_service and not (
            self.memory is not None and self.memory.config.enable_prefix_caching
        )
        for chunk in out.chunks:
            rid, start, num_new, is_prefill, samples = chunk
            request = requests.get(rid)
            if request is None or request.status is not running:
                # finished (cancelled) while its step ran (its id may even be reused): whatever the
                # step generated for it reaches nobody
                self.stats.num_unsent_tokens += len(sampled.get(rid, ()))
                continue
            token_ids = sampled.get(rid)
            if is_prefill or num_new != 1 or not samples or not plain or token_ids is None or len(token_ids) != 1:
                self._apply_chunk(request, chunk, result, now, done)  # (it raises for a missing token)
                continue
            request.num_computed_tokens = start + 1
            request.append_token(token_ids[0], now)
            if request.num_output_tokens >= request.max_output_tokens:
                self._end_at_limit(request, result, now, done)
        self._apply_executor_finishes(out, result, now, done)
        if done:
            self.running = [r for r in self.running if r.status is running]
        return done

    def _apply_chunk(
        self, request: Request, chunk: ScheduledChunk, result: StepResult, now: float, done: list[Request]
    ) -> None:
        """A running request's chunk: a prefill advances the computed tokens (and caches the full
        blocks); a chunk that samples appends the sampled tokens (cut at the output limit), a
        decode first advancing the computed tokens by the accepted ones, then caching its blocks;
        the service is charged when the queue order prices it."""
        if chunk.is_prefill:
            self.advance_prefill(request, chunk)
        if not chunk.samples:
            return
        token_ids = result.sampled_token_ids.get(chunk.request_id)
        if not token_ids:
            raise ValueError(f"step {chunk.request_id!r}: the step result holds no sampled token for it")
        if not chunk.is_prefill:
            if chunk.num_new_tokens == 1:
                request.num_computed_tokens = chunk.start + 1
            else:
                self._advance_decode(request, chunk, len(token_ids))
        room = request.max_output_tokens - request.num_output_tokens
        kept = tuple(token_ids) if len(token_ids) <= room else tuple(token_ids[:room])
        request.append_output(kept, now)
        if not chunk.is_prefill:
            self._cache_blocks(request)
        if self.waiting.charges_service:
            self.waiting.charge(request, len(kept))
        if request.num_output_tokens >= request.max_output_tokens:
            self._end_at_limit(request, result, now, done)

    def _end_at_limit(self, request: Request, result: StepResult, now: float, done: list[Request]) -> None:
        """`request` reached its output limit: it finishes with LENGTH, unless the executor
        finished it in the same step (its reason, stop or error, wins over length)."""
        if result.finished and request.request_id in result.finished:
            return
        self._finish(request, FinishReason.LENGTH, now)
        done.append(request)

    def advance_prefill(self, request: Request, chunk: ScheduledChunk) -> None:
        """`request` computed prefill `chunk` (as `update` applies it; `FastForward` too): its
        computed tokens, the recomputed ones counted, its full blocks cached for prefix reuse."""
        end = chunk.start + chunk.num_new_tokens
        if request.recompute_until > chunk.start:
            self.stats.num_recomputed_tokens += min(end, request.recompute_until) - chunk.start
        request.num_computed_tokens = end
        self._cache_blocks(request)

    def _cache_blocks(self, request: Request) -> None:
        if self.memory is not None and self.memory.config.enable_prefix_caching:
            self.memory.cache_computed_blocks(request)

    def _advance_decode(self, request: Request, chunk: ScheduledChunk, num_sampled: int) -> None:
        """A decode chunk feeds the newest token plus drafts; `num_sampled` - 1 drafts were
        accepted, so that many positions after the newest token keep their KV."""
        num_accepted = min(num_sampled, chunk.num_new_tokens)
        request.num_computed_tokens = chunk.start + num_accepted
        if chunk.num_new_tokens > 1:  # speculative: the rejected drafts' KV is rolled back
            self.stats.num_draft_tokens += chunk.num_new_tokens - 1
            self.stats.num_accepted_draft_tokens += num_accepted - 1
            if self.memory is not None:
                self.memory.roll_back(request)

    def _apply_executor_finishes(
        self, out: SchedulerOutput, result: StepResult, now: float, done: list[Request]
    ) -> None:
        if not result.finished:
            return
        step_ids = {c[0] for c in out.chunks}  # (c[0]: the request id)
        for request_id, reason in result.finished.items():
            if request_id not in step_ids:
                raise ValueError(f"step {out.step_id}: the executor finished {request_id!r}, which was not in the step")
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self._finish(request, reason, now)
                done.append(request)

    # -- lifecycle ---------------------------------------------------------------------------
    def add_request(self, request: Request, now: float) -> AddDecision:
        """Queue `request`, or finish it at once as REJECTED (with the kind and the reason).
        ValueError for an id already in the scheduler or a request that is not new."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {rid!r} is {request.status.value}, not new")
        self.requests[rid] = request
        kind, reason = self.rejection(request)
        bound = self.config.lifecycle.max_waiting
        if not reason and bound is not None and len(self.waiting) >= bound + self._free_seats():
            kind, reason = "queue_full", f"the waiting queue is full ({bound} requests)"
        if reason:
            self.stats.reject(kind)
            self._finish(request, FinishReason.REJECTED, now, reason)
            return AddDecision(False, kind, reason)
        self.waiting.push(request)
        return QUEUED

    def unfinished_requests(self) -> Iterable[Request]:
        """The unfinished requests (a live view: do not finish requests while iterating it)."""
        return self.requests.values()

    def contains(self, request_id: str) -> bool:
        """Whether `request_id` is an unfinished request of this scheduler."""
        return request_id in self.requests

    def get(self, request_id: str) -> Request | None:
        """The unfinished request `request_id`, or None."""
        return self.requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_paused(self) -> int:
        """Running requests paused because their client has not read (no output credits)."""
        return sum(1 for r in self.running if r.paused_since is not None and r.status is RequestStatus.RUNNING)

    def _free_seats(self) -> int:
        """Running slots free now: requests queued for them are about to start, not waiting."""
        if self.config.max_num_seqs is None:
            return 0
        return max(0, self.config.max_num_seqs - len(self.running))

    def rejection(self, request: Request) -> tuple[str, str]:
        """(kind, reason) when `request` can never run under this configuration; ("", "") when
        it can."""
        limit = self.config.max_model_len
        total = request.num_prompt_tokens + request.max_output_tokens
        if limit is not None and total > limit:
            return "max_model_len", f"prompt + max output = {total} tokens exceeds max_model_len {limit}"
        if self.memory is not None:
            reason = self.memory.never_fits(request)
            if reason:
                return "kv_capacity", reason
            quota = self.config.tenants.max_kv_blocks
            need = self.memory.kv.num_blocks_for(request.num_prompt_tokens + request.max_output_tokens)
            if quota is not None and need > quota:
                return "tenant_quota", (
                    f"it needs {need} KV blocks at its full length ({request.num_prompt_tokens} prompt + "
                    f"{request.max_output_tokens} output tokens), over its tenant's quota of {quota}"
                )
        return "", ""

    def cancel(
        self, request_id: str, now: float, reason: FinishReason = FinishReason.CANCELLED, *, detail: str = ""
    ) -> bool:
        """Finish an unfinished request at once (waiting or running) and free its KV blocks;
        False if unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        was_running = request.status is RequestStatus.RUNNING
        self._finish(request, reason, now, detail)  # validates before anything moves
        if was_running:
            self.running.remove(request)
        else:
            self.waiting.remove((request,))
        return True

    def ack(self, request_id: str, num_tokens: int, now: float) -> None:
        """The client took `num_tokens` more output tokens of `request_id` (streaming credits);
        a paused request resumes once half its credits are free again (`lifecycle.may_run`); a
        read short of that restarts its pause (`max_pause` counts from the client's last read).
        Unknown or finished requests are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return
        request.num_sent_tokens = min(request.num_output_tokens, request.num_sent_tokens + num_tokens)
        if request.paused_since is not None and num_tokens > 0:
            resumes = may_run(request, self.config.lifecycle)  # judged while paused: half its credits free
            self.stats.paused_time += request.resume(now)
            if not resumes:
                request.pause(now)  # still behind: paused on, its pause clock restarted by the read

    def expire_timeouts(self, now: float) -> None:
        """End every request past its ttft or request timeout at `now` with TIMEOUT."""
        lifecycle = self.config.lifecycle
        if lifecycle.ttft_timeout is None and lifecycle.request_timeout is None:
            return
        for request in list(self.requests.values()):
            reason = timeout_reason(request, lifecycle, now)
            if reason:
                self.cancel(request.request_id, now, FinishReason.TIMEOUT, detail=reason)

    def next_timer(self) -> float | None:
        """The earliest time a timeout or a pause limit fires by itself (for an idle executor to
        wake up at); None when nothing is timed."""
        lifecycle = self.config.lifecycle
        if not lifecycle.has_timeouts:
            return None
        # a pause preemption needs someone waiting: until then it cannot fire
        pauses = lifecycle.pause_action != "preempt" or bool(self.waiting)
        return next_timer(self.requests.values(), lifecycle, pauses=pauses)

    def _finish(self, request: Request, reason: FinishReason, now: float, detail: str = "") -> None:
        request.finish(reason, now, detail)
        self.stats.paused_time += request.resume(now)
        if reason in (FinishReason.CANCELLED, FinishReason.TIMEOUT, FinishReason.ERROR):
            self.stats.num_unsent_tokens += request.num_unsent_tokens
        del self.requests[request.request_id]
        if self.memory is not None:
            self.memory.release(request)
        self.num_finished += 1
        self._finished_since_output.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- helpers for subclasses ---------------------------------------------------------------
    def _next_step_id(self) -> int:
        step_id = self._step_id
        self._step_id += 1
        return step_id

    def _take_finished_ids(self) -> tuple[str, ...]:
        ids = tuple(self._finished_since_output)
        self._finished_since_output.clear()
        return ids

    def _take_block_deltas(self) -> list[tuple[str, int, tuple[int, ...]]]:
        return self.memory.kv.take_block_deltas() if self.memory is not None else []
