"""Request lifecycle rules that depend on time: timeouts and paused streams.

Pure functions over requests and a `LifecycleConfig`; the scheduler applies their verdicts.
`now` is always an argument. A request times out when it has no output token `ttft_timeout`
after arrival, or is unfinished `request_timeout` after arrival; a running request whose client
stopped reading (its output credits are exhausted) is paused, and once its client has read
nothing for `max_pause` while paused it is preempted (when someone waits for its seat or its
memory; else it keeps both) or ended, as configured.

Hysteresis: a request whose client has fallen behind (it is paused, or back in the queue with
output its client has not read) runs again only once half its credits are free
(`resume_room`): resuming it for a token or two would pay a step, or a whole recompute, for
almost nothing, and pause it again at once.
"""

from __future__ import annotations

from collections.abc import Iterable

from contbatch.core.config import LifecycleConfig
from contbatch.core.request import Request
from contbatch.core.status import RequestStatus


# Each limit is compared as `now >= start + limit`, the very sum `next_timer` reports, so a timer
# that fires at its reported time is never missed by float rounding.
def timeout_reason(request: Request, config: LifecycleConfig, now: float) -> str:
    """Why `request` has timed out at `now`; empty when it has not."""
    arrival = request.arrival_ts
    if config.request_timeout is not None and now >= arrival + config.request_timeout:
        return f"unfinished {config.request_timeout:g} after arrival (request_timeout)"
    ttft = config.ttft_timeout
    if ttft is not None and request.num_output_tokens == 0 and now >= arrival + ttft:
        return f"no output token {ttft:g} after arrival (ttft_timeout)"
    return ""


def paused_too_long(request: Request, config: LifecycleConfig, now: float) -> bool:
    since = request.paused_since
    return config.max_pause is not None and since is not None and now >= since + config.max_pause


def credit_room(request: Request, config: LifecycleConfig) -> int | None:
    """Output tokens the request may still generate before its client reads; None: unlimited."""
    if config.output_credits is None:
        return None
    return config.output_credits - request.num_unsent_tokens


def resume_room(config: LifecycleConfig) -> int:
    """Credits that must be free before a request whose client fell behind runs again."""
    return max(1, (config.output_credits or 0) // 2)


def may_run(request: Request, config: LifecycleConfig) -> bool:
    """Whether `request`'s client leaves it room to run now (see the hysteresis above)."""
    room = credit_room(request, config)
    if room is None:
        return True
    behind = request.paused_since is not None or (
        request.num_unsent_tokens > 0 and request.status is not RequestStatus.RUNNING
    )
    return room >= resume_room(config) if behind else room > 0


def next_timer(requests: Iterable[Request], config: LifecycleConfig, *, pauses: bool = True) -> float | None:
    """The earliest time at which a timeout or a pause limit (with `pauses`) fires for one of
    `requests`."""
    times: list[float] = []
    for r in requests:
        if config.request_timeout is not None:
            times.append(r.arrival_ts + config.request_timeout)
        if config.ttft_timeout is not None and r.num_output_tokens == 0:
            times.append(r.arrival_ts + config.ttft_timeout)
        if pauses and config.max_pause is not None and r.paused_since is not None:
            times.append(r.paused_since + config.max_pause)
    return min(times) if times else None
