"""The scheduler's view of one request.

A `Request` is owned by exactly one scheduler. Its token accounting is token-centric:
the request needs `num_prompt_tokens` of prefill, then one decode token per step; a step
gives it `num_new_tokens` that advance `num_computed_tokens`.

Invariants:
- 0 <= num_computed_tokens <= num_known_tokens (prompt + outputs so far);
- num_output_tokens <= max_output_tokens; output tokens only grow;
- `status` moves only along the edges of `contbatch.core.status` (checked on every move);
- FINISHED happens once, and the timeline records the same reason;
- `prompt_token_ids` is empty (the simulator knows lengths only) or has `num_prompt_tokens` ids;
- 0 <= num_external_tokens <= num_prompt_tokens.

External KV (`num_external_tokens`): the KV of that many leading prompt tokens was computed
elsewhere and arrives with the request (a KV transfer from a prefill replica, in disaggregated
serving). Its first admission starts after them, exactly as after a prefix-cache hit (the larger
of the two counts, at most prompt - 1: one token is computed to sample from, as vLLM does), its
blocks are allocated under this scheduler's KV budget like any admission's, and a request
preempted by recompute later computes its whole prompt here.
"""

from __future__ import annotations

from contbatch.core.status import FinishReason, RequestStatus, check_transition
from contbatch.core.timeline import Timeline


class Request:
    __slots__ = (
        "block_hashes",
        "deadline_ts",
        "finish_detail",
        "finish_reason",
        "kv_capacity",
        "max_output_tokens",
        "num_computed_tokens",
        "num_external_tokens",
        "num_output_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_sent_tokens",
        "output_token_ids",
        "params",
        "paused_since",
        "paused_time",
        "priority",
        "prompt_token_ids",
        "recompute_until",
        "request_id",
        "skip_reading_prefix_cache",
        "status",
        "tenant",
        "timeline",
    )

    def __init__(
        self,
        request_id: str,
        arrival_ts: float,
        num_prompt_tokens: int,
        max_output_tokens: int,
        *,
        priority: int = 0,
        tenant: str | None = None,
        deadline_ts: float | None = None,
        block_hashes: tuple[int, ...] = (),
        prompt_token_ids: tuple[int, ...] = (),
        params: object = None,
        num_external_tokens: int = 0,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        if num_prompt_tokens < 1:
            raise ValueError(f"request {request_id!r}: num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        if max_output_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_output_tokens must be >= 1, got {max_output_tokens}")
        if not 0 <= num_external_tokens <= num_prompt_tokens:
            raise ValueError(
                f"request {request_id!r}: num_external_tokens must be in [0, {num_prompt_tokens}], "
                f"got {num_external_tokens}"
            )
        if prompt_token_ids and len(prompt_token_ids) != num_prompt_tokens:
            raise ValueError(
                f"request {request_id!r}: {len(prompt_token_ids)} prompt token ids, {num_prompt_tokens} prompt tokens"
            )
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.priority = priority
        self.tenant = tenant
        self.deadline_ts = deadline_ts
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_external_tokens = num_external_tokens  # leading prompt tokens whose KV arrives from elsewhere
        self.num_output_tokens = 0
        self.output_token_ids: list[int] = []
        self.num_preemptions = 0
        self.block_hashes = block_hashes  # one per full block, prompt then output (contbatch.core.block_hashes)
        # computes every position itself (prompt logprobs need them: vLLM's rule); its blocks are still cached
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.prompt_token_ids = prompt_token_ids  # empty when only lengths are known (the simulator)
        self.params = params  # the executor's per-request parameters (sampling); the scheduler never reads them
        self.recompute_until = 0  # positions below this were computed before a recompute preemption
        self.num_sent_tokens = 0  # output tokens the client has taken (acknowledged)
        self.kv_capacity = 0  # tokens its device KV blocks can hold (kept by contbatch.core.memory)
        self.paused_since: float | None = None  # when its output credits ran out, while they are out
        self.paused_time = 0.0  # total time spent paused
        self.finish_reason: FinishReason | None = None
        self.finish_detail = ""  # why, in words, for REJECTED / ERROR / TIMEOUT
        self.timeline = Timeline(
            request_id, arrival_ts, num_prompt_tokens, tenant=tenant, priority=priority, deadline_ts=deadline_ts
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}/{self.max_output_tokens})"
        )

    @property
    def arrival_ts(self) -> float:
        return self.timeline.arrival_ts

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids exist: the prompt plus every output token sampled so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    # -- state machine: each move validates first (status edge, then timestamp), so a refused
    # move leaves the request exactly as it was.
    def move_to(self, new: RequestStatus) -> None:
        check_transition(self.request_id, self.status, new)
        self.status = new

    def admit(self, now: float) -> None:
        check_transition(self.request_id, self.status, RequestStatus.RUNNING)
        self.timeline.record_scheduled(now)
        self.status = RequestStatus.RUNNING

    def preempt(self, now: float, *, keep_computed: bool = False) -> None:
        """Back to the waiting queue. Recompute drops the KV (`num_computed_tokens` = 0); a swap
        keeps it (`keep_computed`), parked in host memory."""
        check_transition(self.request_id, self.status, RequestStatus.PREEMPTED)
        self.timeline.record_preempted(now)
        self.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        if not keep_computed:
            self.recompute_until = max(self.recompute_until, self.num_computed_tokens)
            self.num_computed_tokens = 0

    def finish(self, reason: FinishReason, now: float, detail: str = "") -> None:
        check_transition(self.request_id, self.status, RequestStatus.FINISHED)
        self.timeline.record_finished(now, reason)
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_detail = detail

    @property
    def num_unsent_tokens(self) -> int:
        """Output tokens generated but not yet taken by the client."""
        return self.num_output_tokens - self.num_sent_tokens

    def pause(self, now: float) -> None:
        if self.paused_since is None:
            self.paused_since = now

    def resume(self, now: float) -> float:
        """End a pause; returns its length (0.0 when not paused)."""
        if self.paused_since is None:
            return 0.0
        length = now - self.paused_since
        self.paused_time += length
        self.paused_since = None
        return length

    def append_token_run(self, token_id: int, ts_list: list[float]) -> None:
        """`len(ts_list)` decode steps at once: one `token_id` at each timestamp."""
        self.output_token_ids.extend([token_id] * len(ts_list))
        self.num_output_tokens += len(ts_list)
        self.num_computed_tokens += len(ts_list)
        self.timeline.record_token_run(ts_list)

    def append_token(self, token_id: int, now: float) -> None:
        """One output token at `now` (`append_output((token_id,), now)`, the decode hot path);
        the caller knows there is room for it (a running request finishes once it is full)."""
        self.output_token_ids.append(token_id)
        self.num_output_tokens += 1
        self.timeline.record_tokens(now)

    def append_output(self, token_ids: tuple[int, ...], now: float) -> None:
        num_tokens = len(token_ids)
        self.output_token_ids.extend(token_ids)
        self.num_output_tokens += num_tokens
        self.timeline.record_tokens(now, num_tokens)
