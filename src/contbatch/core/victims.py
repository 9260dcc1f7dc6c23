"""Choosing whom to preempt when a running request cannot grow.

`running` is in admission order (the last one is the newest). Requests preempted
`max_preemptions` times or more are chosen only when no other candidate is left, so a request
cannot be thrashed without bound. The request asking for memory is itself a candidate: when it
is chosen, it is the one that yields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contbatch.core.request import Request

# Each key ranks a candidate; the victim has the largest key. Ties go to the newest (largest index).
_RANKS: dict[str, Callable[[Request, int], tuple[float, ...]]] = {
    "newest": lambda r, i: (i,),
    "lowest_priority": lambda r, i: (r.priority, i),
    "fewest_generated": lambda r, i: (-r.num_output_tokens, i),
}


def choose_victim(running: Sequence[Request], policy: str, max_preemptions: int | None) -> Request:
    """The request to preempt among `running` (non-empty)."""
    rank = _RANKS[policy]
    candidates = list(enumerate(running))
    if max_preemptions is not None:
        fresh = [(i, r) for i, r in candidates if r.num_preemptions < max_preemptions]
        candidates = fresh or candidates
    _, victim = max(candidates, key=lambda pair: rank(pair[1], pair[0]))
    return victim
