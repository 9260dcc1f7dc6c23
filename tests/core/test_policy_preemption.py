"""Priority preemption and per-tenant quotas (`contbatch.core.admission`), stepped by hand.

- `priority_preemption=T`: a waiting request whose priority value is at least T lower than a
  running one's preempts it when a seat (max_num_seqs) or KV memory is short: the victim is the
  lowest-priority running request (largest value, newest on ties), it goes back to the queue,
  its KV is freed and `stats.num_priority_preemptions` counts it. Below T nothing is preempted.
- `tenants.max_running` / `tenants.max_kv_blocks`: a request of a tenant at its quota is skipped
  (it keeps its place) and a request of another tenant behind it in the queue is admitted.
"""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    FinishReason,
    RequestStatus,
    SchedulerConfig,
)
from contbatch.core.config import KVConfig, TenantConfig

from .drive import admit, held, scheduled_ids, step


def kv(num_blocks: int, block_size: int = 1) -> KVConfig:
    return KVConfig(block_size=block_size, num_blocks=num_blocks, watermark=0.0)


# -- priority preemption at the sequence limit --------------------------------------------------
@pytest.mark.parametrize("with_kv", [False, True])
@pytest.mark.parametrize("gap", [2, 5])
def test_waiting_request_beating_a_running_one_by_the_threshold_preempts_it(with_kv: bool, gap: int) -> None:
    config = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, priority_preemption=2, kv=kv(64) if with_kv else None
    )
    s = ContinuousScheduler(config)
    lo = admit(s, "lo", 0.0, 3, 10, priority=5)
    step(s, 0.0)
    step(s, 1.0)
    assert lo.status is RequestStatus.RUNNING and lo.num_output_tokens == 2
    if with_kv:
        assert held(s, "lo") == 4
    hi = admit(s, "hi", 2.0, 2, 2, priority=5 - gap)
    out = step(s, 2.0)
    assert out.preempted_ids == ("lo",) and scheduled_ids(out) == ["hi"]
    assert s.stats.num_priority_preemptions == 1
    assert lo.status is RequestStatus.PREEMPTED and lo in list(s.waiting) and lo not in s.running
    assert lo.timeline.preempted_ts == [2.0] and lo.num_computed_tokens == 0
    if with_kv:
        assert held(s, "lo") == 0 and held(s, "hi") == 2  # its prompt (the sampled token is not computed)
    assert hi.timeline.scheduled_ts == [2.0] and hi.num_output_tokens == 1
    now = 3.0
    while s.has_unfinished():
        step(s, now)
        now += 1.0
    assert hi.finish_reason is lo.finish_reason is FinishReason.LENGTH
    assert lo.num_output_tokens == 10 and s.stats.num_priority_preemptions == 1
    assert hi.timeline.finished_ts is not None and lo.timeline.scheduled_ts[1] == hi.timeline.finished_ts


@pytest.mark.parametrize("with_kv", [False, True])
def test_below_the_threshold_nothing_is_preempted(with_kv: bool) -> None:
    config = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, priority_preemption=3, kv=kv(64) if with_kv else None
    )
    s = ContinuousScheduler(config)
    lo = admit(s, "lo", 0.0, 3, 4, priority=5)
    step(s, 0.0)
    hi = admit(s, "hi", 1.0, 2, 2, priority=3)  # better by 2 < 3
    for t in (1.0, 2.0, 3.0):
        out = step(s, t)
        assert scheduled_ids(out) == ["lo"] and not out.preempted_ids
    assert lo.finish_reason is FinishReason.LENGTH and hi.status is RequestStatus.WAITING
    assert s.stats.num_priority_preemptions == 0 and s.stats.num_preemptions == 0


def test_equal_priority_never_preempts_and_no_threshold_means_no_preemption() -> None:
    for threshold, priority in ((1, 5), (None, 0)):
        s = ContinuousScheduler(
            SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=1, priority_preemption=threshold)
        )
        admit(s, "lo", 0.0, 3, 4, priority=5)
        step(s, 0.0)
        admit(s, "hi", 1.0, 2, 2, priority=priority)
        out = step(s, 1.0)
        assert scheduled_ids(out) == ["lo"] and s.stats.num_priority_preemptions == 0


def test_the_victim_is_the_lowest_priority_running_request_newest_on_ties() -> None:
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3, priority_preemption=1)
    s = ContinuousScheduler(config)
    admit(s, "p3-old", 0.0, 1, 10, priority=3)
    admit(s, "p4-old", 0.0, 1, 10, priority=4)
    admit(s, "p4-new", 0.0, 1, 10, priority=4)
    step(s, 0.0)
    admit(s, "a", 1.0, 1, 5, priority=0)
    admit(s, "b", 1.0, 1, 5, priority=0)
    out = step(s, 1.0)
    # a takes p4-new's seat, b takes p4-old's; p3-old (better than both 4s) keeps running
    assert out.preempted_ids == ("p4-new", "p4-old") and s.stats.num_priority_preemptions == 2
    assert sorted(scheduled_ids(out)) == ["a", "b", "p3-old"]
    # preempted requests go back after the candidate iteration, in preemption order at the front
    assert [r.request_id for r in s.waiting] == ["p4-old", "p4-new"]


def test_priority_preemption_frees_kv_for_a_request_that_does_not_fit() -> None:
    # seats are plenty; the pool (12 one-token blocks) is the limit
    config = SchedulerConfig(max_num_batched_tokens=32, priority_preemption=2, kv=kv(12))
    s = ContinuousScheduler(config)
    lo = admit(s, "lo", 0.0, 8, 2, priority=4)
    keep = admit(s, "keep", 0.0, 2, 4, priority=3)
    step(s, 0.0)
    assert held(s, "lo") == 8 and held(s, "keep") == 2
    hi = admit(s, "hi", 1.0, 6, 2, priority=1)  # needs 6 blocks, 2 are free
    out = step(s, 1.0)
    assert out.preempted_ids == ("lo",) and s.stats.num_priority_preemptions == 1
    assert held(s, "lo") == 0 and lo.status is RequestStatus.PREEMPTED and lo.kv_capacity == 0
    assert "hi" in scheduled_ids(out) and held(s, "hi") == 6 and hi.status is RequestStatus.RUNNING
    # keep (3 - 1 >= 2) could be a victim too, but lo is the lowest priority and freeing it is enough
    assert keep.status is RequestStatus.RUNNING
    now = 2.0
    while s.has_unfinished():
        step(s, now)
        now += 1.0
    assert all(r.finish_reason is FinishReason.LENGTH for r in (lo, keep, hi))
    assert s.memory is not None and s.memory.kv.num_used_blocks == 0


def test_a_refused_admission_preempts_nobody() -> None:
    # pool of 10 one-token blocks. In step 1 keep (priority 0) grows to 7 blocks and lo (priority 5)
    # to 3: none is free. hi (priority 0, prompt 5) beats lo by 5 >= 1, but lo's 3 blocks are not
    # enough for hi's 5 and keep is no victim (same priority): hi cannot be admitted, so lo must
    # keep running (it used to be preempted for nothing: its KV dropped, its step refunded).
    config = SchedulerConfig(max_num_batched_tokens=32, priority_preemption=1, kv=kv(10))
    s = ContinuousScheduler(config)
    admit(s, "keep", 0.0, 6, 3, priority=0)
    lo = admit(s, "lo", 0.0, 2, 3, priority=5)
    step(s, 0.0)
    admit(s, "hi", 1.0, 5, 1, priority=0)
    out = step(s, 1.0)
    assert "hi" not in scheduled_ids(out)
    assert not out.preempted_ids and lo.status is RequestStatus.RUNNING
    assert s.stats.num_priority_preemptions == 0


def test_only_as_many_victims_as_needed_are_preempted() -> None:
    # pool of 12 one-token blocks; lo-a (priority 5) and lo-b (priority 4) hold 4 blocks each during
    # step 1, keep (priority 0) 3: one free. hi (priority 0, prompt 4) needs 4: lo-a's blocks are
    # enough, so lo-b keeps running.
    config = SchedulerConfig(max_num_batched_tokens=32, priority_preemption=1, kv=kv(12))
    s = ContinuousScheduler(config)
    admit(s, "keep", 0.0, 2, 4, priority=0)
    lo_a = admit(s, "lo-a", 0.0, 3, 4, priority=5)
    lo_b = admit(s, "lo-b", 0.0, 3, 4, priority=4)
    step(s, 0.0)
    admit(s, "hi", 1.0, 4, 1, priority=0)
    out = step(s, 1.0)
    assert out.preempted_ids == ("lo-a",) and s.stats.num_priority_preemptions == 1
    assert "hi" in scheduled_ids(out) and lo_b.status is RequestStatus.RUNNING
    assert lo_a.status is RequestStatus.PREEMPTED and held(s, "lo-a") == 0


# -- tenant quotas ------------------------------------------------------------------------------
@pytest.mark.parametrize("queue_order", ["fcfs", "priority", "fair"])
def test_tenant_at_max_running_waits_while_another_tenant_behind_it_is_admitted(queue_order: str) -> None:
    config = SchedulerConfig(max_num_batched_tokens=32, queue_order=queue_order, tenants=TenantConfig(max_running=1))
    s = ContinuousScheduler(config)
    a0 = admit(s, "a0", 0.0, 2, 3, tenant="a")
    step(s, 0.0)
    a1 = admit(s, "a1", 1.0, 2, 3, tenant="a")
    b0 = admit(s, "b0", 2.0, 2, 3, tenant="b")
    out = step(s, 2.0)
    assert scheduled_ids(out) == ["a0", "b0"]  # a1 is ahead of b0 in the queue, but a is at its quota
    assert a1.status is RequestStatus.WAITING and [r.request_id for r in s.waiting] == ["a1"]
    out = step(s, 3.0)  # a0 finishes in this step (its third token)
    assert a0.finish_reason is FinishReason.LENGTH and a1.status is RequestStatus.WAITING
    out = step(s, 4.0)
    assert "a1" in scheduled_ids(out) and a1.timeline.scheduled_ts == [4.0]
    assert b0.timeline.scheduled_ts == [2.0]


def test_max_running_also_counts_admissions_of_the_same_step() -> None:
    config = SchedulerConfig(max_num_batched_tokens=32, tenants=TenantConfig(max_running=2))
    s = ContinuousScheduler(config)
    for rid, tenant in (("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b"), ("n0", None), ("n1", None)):
        admit(s, rid, 0.0, 1, 2, tenant=tenant)
    out = step(s, 0.0)
    assert scheduled_ids(out) == ["a0", "a1", "b0", "n0", "n1"]  # no tenant counts as one tenant too
    assert [r.request_id for r in s.waiting] == ["a2"]


def test_tenant_at_max_kv_blocks_waits_while_another_tenant_behind_it_is_admitted() -> None:
    # blocks of 4 tokens; tenant quota 3 blocks; a0 (prompt 7) holds 2 blocks for its first 8
    # positions, so in step 1 (decoding position 7) too; a1 needs 2 more, a-small 1
    config = SchedulerConfig(max_num_batched_tokens=64, kv=kv(64, 4), tenants=TenantConfig(max_kv_blocks=3))
    s = ContinuousScheduler(config)
    a0 = admit(s, "a0", 0.0, 7, 4, tenant="a")
    step(s, 0.0)
    assert held(s, "a0") == 2
    a1 = admit(s, "a1", 1.0, 5, 2, tenant="a")
    small = admit(s, "a-small", 1.0, 4, 2, tenant="a")  # needs 1 block: fits the quota beside a0
    b0 = admit(s, "b0", 1.0, 9, 2, tenant="b")  # 3 blocks: exactly b's quota
    out = step(s, 1.0)
    assert scheduled_ids(out) == ["a0", "a-small", "b0"]
    assert a1.status is RequestStatus.WAITING and small.status is b0.status is RequestStatus.RUNNING
    assert held(s, "a0") + held(s, "a-small") == 3 and held(s, "b0") == 3
    now = 2.0
    while a1.timeline.scheduled_ts == []:
        step(s, now)
        now += 1.0
    # a1 starts only once a's holdings leave room for its 2 prompt blocks
    assert a0.timeline.finished_ts is not None and a1.timeline.scheduled_ts[0] >= a0.timeline.finished_ts
    while s.has_unfinished():
        step(s, now)
        now += 1.0
    assert a0.finish_reason is a1.finish_reason is FinishReason.LENGTH


def test_quota_skip_does_not_block_under_strict_order() -> None:
    # skip_blocked=False: a request that does not fit blocks the queue, but one at its quota does not
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, tenants=TenantConfig(max_running=1))
    assert not config.skip_blocked
    s = ContinuousScheduler(config)
    admit(s, "a0", 0.0, 1, 5, tenant="a")
    step(s, 0.0)
    for i in range(3):
        admit(s, f"a{i + 1}", 1.0, 1, 5, tenant="a")
    admit(s, "b0", 1.0, 1, 5, tenant="b")
    admit(s, "c0", 1.0, 1, 5, tenant="c")
    out = step(s, 1.0)
    assert scheduled_ids(out) == ["a0", "b0", "c0"]


def test_tenant_kv_quota_holds_as_requests_grow() -> None:
    """The quota is checked as running requests grow, not only at admission: two requests of
    tenant a (3 blocks each at full length, quota 4) are both admitted on their 1-block prompts;
    when their growth would take a past 4 blocks, a's newest request yields (preempted, then
    readmitted when a has room), and both finish. It used to hold 6."""
    config = SchedulerConfig(max_num_batched_tokens=64, kv=kv(64, 4), tenants=TenantConfig(max_kv_blocks=4))
    s = ContinuousScheduler(config)
    a0 = admit(s, "a0", 0.0, 4, 8, tenant="a")
    a1 = admit(s, "a1", 0.0, 4, 8, tenant="a")
    now, peak = 0.0, 0
    while s.has_unfinished():
        step(s, now)
        peak = max(peak, sum(held(s, r.request_id) for r in s.running if r.tenant == "a"))
        now += 1.0
    assert peak == 4 and s.stats.num_preemptions >= 1 and a1.num_preemptions >= 1
    assert a0.finish_reason is a1.finish_reason is FinishReason.LENGTH


def test_tenant_kv_quota_counts_the_whole_reservation_under_reserve_admission() -> None:
    """Under reserve admission a request takes prompt + max output blocks at once: with a quota of
    8 blocks, a tenant running a 1 + 4 reservation cannot admit a 3 + 2 one beside it (it would
    hold 10); it waits until the first finishes. It used to be admitted on its 3-block prompt alone."""
    config = SchedulerConfig(
        max_num_batched_tokens=16,
        kv=KVConfig(block_size=1, num_blocks=32, watermark=0.0, admission="reserve"),
        tenants=TenantConfig(max_kv_blocks=8),
    )
    s = ContinuousScheduler(config)
    small = admit(s, "small", 0.0, 1, 4)
    step(s, 0.0)
    big = admit(s, "big", 1.0, 3, 2)
    now, peak = 1.0, 0
    while s.has_unfinished():
        step(s, now)
        peak = max(peak, sum(held(s, r.request_id) for r in s.running))
        now += 1.0
    assert peak <= 8
    assert small.finish_reason is big.finish_reason is FinishReason.LENGTH
