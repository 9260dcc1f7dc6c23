"""The values that cross the server's thread boundary: submissions in, events out.

The HTTP layer (asyncio) builds a `Submission`; the driver thread turns it into a scheduler
`Request` and answers with `RequestEvent`s (the step loop's `RequestOutput`s), in order: first
either one with ``queued`` or a final one (rejected), then token events, then exactly one final
event (one with a `finish_reason`; it may carry the last tokens). Timestamps are the driver's
clock (`time.monotonic()` seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contbatch.loop.core import RequestOutput
from contbatch.loop.params import SamplingParams

RequestEvent = RequestOutput  # what the driver sends a request's stream

__all__ = ["DriverSnapshot", "RequestEvent", "SamplingParams", "Submission"]


@dataclass(frozen=True, slots=True)
class Submission:
    request_id: str  # unique among the requests the driver has not finished
    prompt_token_ids: tuple[int, ...]  # len >= 1
    params: SamplingParams
    arrival_ts: float  # the driver's clock, when the HTTP request arrived
    priority: int = 0  # lower runs first (with a priority queue order)
    tenant: str | None = None


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
    rejections: dict[str, int] = field(default_factory=dict)  # kind -> submissions the driver refused itself
