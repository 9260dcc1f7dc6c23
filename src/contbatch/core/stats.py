"""Run-level counters a scheduler keeps as it works (what timelines cannot show).

Counters only grow. `as_dict()` is JSON-ready; the simulator adds time-weighted KV usage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0  # every preemption, by recompute or swap
    num_recompute_preemptions: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_recomputed_tokens: int = 0  # prefill tokens computed again after a recompute preemption
    num_prefix_query_tokens: int = 0  # prompt tokens of first admissions, with prefix caching on
    num_prefix_hit_tokens: int = 0  # ... of which found in the prefix cache (prefill saved)
    num_bucket_padding_tokens: int = 0  # tokens added to reach a batch bucket
    num_draft_tokens: int = 0  # speculative draft tokens verified
    num_accepted_draft_tokens: int = 0  # ... of which accepted
    num_unsent_tokens: int = 0  # generated but never taken: the request ended (cancel, timeout, error) first
    num_priority_preemptions: int = 0  # preemptions in favour of a higher-priority waiting request
    num_pause_preemptions: int = 0  # running requests preempted because their client stopped reading
    paused_time: float = 0.0  # total time running requests spent paused by output credits
    rejections: dict[str, int] = field(default_factory=dict)  # reject kind -> count

    def reject(self, kind: str) -> None:
        self.rejections[kind] = self.rejections.get(kind, 0) + 1

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.num_prefix_query_tokens:
            return None
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens

    @property
    def draft_acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_draft_tokens / self.num_draft_tokens

    def as_dict(self) -> dict[str, object]:
        values: dict[str, object] = asdict(self)
        values["rejections"] = dict(sorted(self.rejections.items()))
        values["prefix_hit_rate"] = self.prefix_hit_rate
        values["draft_acceptance_rate"] = self.draft_acceptance_rate
        return values
