"""The values that cross the server's thread boundary: submissions in, events out.

The HTTP layer (asyncio) builds a `Submission`; the driver thread turns it into a scheduler
`Request` and answers with `RequestEvent`s, in order: first either ``admitted`` or a final event
(rejected), then token events, then exactly one final event (one with a `finish_reason`; it may
carry the last tokens). Timestamps are the driver's clock (`time.monotonic()` seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contbatch.core.status import FinishReason


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int  # output tokens at most, >= 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    ignore_eos: bool = False  # True: only max_tokens (or a stop string) ends the request


@dataclass(frozen=True, slots=True)
class Submission:
    request_id: str  # unique among the requests the driver has not finished
    prompt_token_ids: tuple[int, ...]  # len >= 1
    params: SamplingParams
    arrival_ts: float  # the driver's clock, when the HTTP request arrived
    priority: int = 0  # lower runs first (with a priority queue order)
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class RequestEvent:
    request_id: str
    ts: float  # the driver's clock
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, this event's tokens included
    token_ids: tuple[int, ...] = ()  # new output tokens of this event
    text: str = ""  # new text of this event (stop strings cut out)
    admitted: bool = False  # the scheduler queued the request (the first event, unless rejected)
    finish_reason: FinishReason | None = None  # set on the final event only
    finish_detail: str = ""  # why, in words (REJECTED, TIMEOUT, ERROR, CANCELLED)
    reject_kind: str = ""  # REJECTED only: queue_full, max_model_len, kv_capacity, token_budget, ...

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class DriverSnapshot:
    """The scheduler's state after the latest step, copied on the driver thread (safe to read
    from any thread)."""

    ts: float = 0.0
    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_paused: int = 0  # running requests whose client has not read (no output credits left)
    num_live: int = 0  # submitted, not yet finished (queued in the driver's inbox or in the scheduler)
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_generated_tokens: int = 0  # output tokens appended to requests, whole run
    num_padding_tokens: int = 0  # token-work computed for no request, whole run
    num_failed_steps: int = 0  # steps whose executor raised
    accepting: bool = True  # False once shutdown began
    stats: dict[str, object] = field(default_factory=dict)  # SchedulerStats.as_dict()
