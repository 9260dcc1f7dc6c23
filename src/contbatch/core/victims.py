"""Choosing whom to preempt when a running request cannot grow.

`running` is in admission order (the last one is the newest). Requests preempted
`max_preemptions` times or more are chosen only when no other candidate is left, so a request
cannot be thrashed without bound. The request asking for memory is itself a candidate: when it
is chosen, it is the one that yields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contbatch.core.request import Request

# Each key ranks a candidate (the request, its index, the tokens it has generated); the victim
# has the largest key. Ties go to the newest (largest index).
_RANKS: dict[str, Callable[[Request, int, int], tuple[float, ...]]] = {
    "newest": lambda r, i, generated: (i,),
    "lowest_priority": lambda r, i, generated: (r.priority, i),
    "fewest_generated": lambda r, i, generated: (-generated, i),
}


def choose_victim(running: Sequence[Request], policy: str, max_preemptions: int | None) -> Request:
    """The request to preempt among `running` (non-empty)."""
    return running[victim_index(running, policy, max_preemptions)]


def victim_index(
    running: Sequence[Request], policy: str, max_preemptions: int | None, generated: Sequence[int] | None = None
) -> int:
    """The index in `running` (non-empty) of the request to preempt; `generated[i]`: the tokens
    `running[i]` has generated, when the caller counts them (default: each request's own count)."""
    rank = _RANKS[policy]
    counts = generated if generated is not None else [r.num_output_tokens for r in running]
    candidates = list(range(len(running)))
    if max_preemptions is not None:
        fresh = [i for i in candidates if running[i].num_preemptions < max_preemptions]
        candidates = fresh or candidates
    return max(candidates, key=lambda i: rank(running[i], i, counts[i]))
