"""Prefill/decode disaggregation in the cluster simulator: the prefill runs as a request with
output limit 1, its KV crosses the link (priced from bytes per token, latency, and queued behind
other transfers on a port), the decode replica admits it under its own budget (waiting, never
dropped) or it is rejected with its reason before any prefill, TTFT counts all of it, and each
pool has its own router."""

from __future__ import annotations

import dataclasses

import pytest

from contbatch.core import FinishReason, SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.sim import parse_cost
from contbatch.sim.cluster import simulate_cluster
from contbatch.sim.cluster_config import DisaggConfig, FleetError, FleetSpec, LinkConfig, PoolSpec
from contbatch.sim.cluster_transfer import KVLink, kv_bytes_per_token
from contbatch.sim.cost import AffineCost
from contbatch.traces import Trace, TraceRequest

from .conftest import check_all

COST = AffineCost()
CONFIG = SchedulerConfig(max_num_batched_tokens=4096, kv=KVConfig(block_size=16, num_blocks=512, watermark=0.0))
LINK = LinkConfig(bandwidth=1e6, latency=0.002, kv_bytes_per_token=100.0)  # 10 us a token


def fleet(
    prefill: int = 1,
    decode: int = 1,
    *,
    decode_config: SchedulerConfig = CONFIG,
    threshold: int = 0,
    router: str = "round_robin",
    link: LinkConfig = LINK,
) -> FleetSpec:
    pools = (
        PoolSpec("p", COST, CONFIG, prefill, role="prefill"),
        PoolSpec("d", COST, decode_config, decode, role="decode"),
    )
    return FleetSpec(pools, router=router, prefill_router=router, disagg=DisaggConfig(threshold, link)).check()


def trace(*rows: tuple[float, int, int]) -> Trace:
    return Trace("pd", tuple(TraceRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(rows)), "s", "test")


def price(chunks: list[ScheduledChunk]) -> float:
    return COST.step_time(build_output(0, chunks))


def test_ttft_counts_prefill_transfer_and_the_first_decode_step() -> None:
    result = simulate_cluster(trace((0.0, 1000, 4)), fleet(), inspect=check_all)
    (tl,) = result.timelines
    prefill = price([ScheduledChunk("r0", 0, 1000, True, True)])
    transfer = 1000 * 100.0 / 1e6 + 0.002
    first = price([ScheduledChunk("r0", 999, 1, True, True)])  # the last prompt token, recomputed to sample
    assert tl.first_token_ts == pytest.approx(prefill + transfer + first)
    assert tl.scheduled_ts[0] == 0.0  # the fleet's first admission: the prefill's
    assert tl.num_output_tokens == 4 and tl.finish_reason is FinishReason.LENGTH
    assert result.transfers["num_transfers"] == 1 and result.transfers["transfer_bytes"] == 100_000.0


def test_transfers_queue_on_a_port() -> None:
    result = simulate_cluster(trace((0.0, 1000, 2), (0.0, 1000, 2)), fleet(), inspect=check_all)
    # r1 is prefilled in the step after r0's; its hand-off finds r0's transfer still on both ports
    assert 0.0 < result.transfers["transfer_max_wait"] < 0.1  # type: ignore[operator]
    link = KVLink(LINK, 100.0)
    first, second = link.transfer("p-0", "d-0", 1000, 0.0), link.transfer("p-1", "d-0", 1000, 0.0)
    assert second == pytest.approx(first + 0.1)  # same decode port: after the first's 0.1 s
    assert link.transfer("p-2", "d-1", 1000, 0.0) == pytest.approx(first)  # other ports: in parallel
    assert link.stats.max_wait == pytest.approx(0.1)


def test_a_request_that_can_never_fit_the_decode_side_is_rejected_before_its_prefill() -> None:
    small = dataclasses.replace(CONFIG, kv=KVConfig(block_size=16, num_blocks=8, watermark=0.0))  # 128 tokens
    result = simulate_cluster(trace((0.0, 200, 4), (0.1, 60, 4)), fleet(decode_config=small), inspect=check_all)
    big, fits = result.timelines
    assert big.finish_reason is FinishReason.REJECTED and big.finished_ts == 0.0
    assert fits.finish_reason is FinishReason.LENGTH
    prefill = next(r for r in result.replicas if r.pool == "p")
    assert prefill.num_routed == 1  # the rejected one never reached a prefill replica


def test_the_decode_side_waits_for_blocks_and_drops_nothing() -> None:
    small = dataclasses.replace(CONFIG, kv=KVConfig(block_size=16, num_blocks=12, watermark=0.0))  # 192 tokens
    rows = [(0.01 * i, 150, 30) for i in range(6)]  # one at a time fits the decode side
    result = simulate_cluster(trace(*rows), fleet(2, 1, decode_config=small), inspect=check_all)
    assert [t.finish_reason for t in result.timelines] == [FinishReason.LENGTH] * 6
    firsts = sorted(t.first_token_ts or 0.0 for t in result.timelines)
    lasts = sorted(t.finished_ts or 0.0 for t in result.timelines)
    assert all(firsts[i + 1] >= lasts[i] for i in range(5))  # each waited for the one before to finish


def test_each_pool_has_its_own_round_robin() -> None:
    """BLIS shared one counter between its pools, so every prefill went to one instance."""
    rows = [(0.5 * i, 300, 8) for i in range(8)]
    result = simulate_cluster(trace(*rows), fleet(2, 2), inspect=check_all)
    routed = {r.replica_id: r.num_routed for r in result.replicas}
    assert routed == {"p-0": 4, "p-1": 4, "d-0": 4, "d-1": 4}


def test_selective_disaggregation_keeps_short_prompts_on_the_decode_side() -> None:
    rows = [(0.2 * i, 100 if i % 2 else 900, 6) for i in range(6)]
    result = simulate_cluster(trace(*rows), fleet(threshold=500), inspect=check_all)
    assert result.transfers["num_disaggregated"] == 3 and result.transfers["num_decode_only"] == 3
    assert all(t.finish_reason is FinishReason.LENGTH for t in result.timelines)


def test_a_transferred_request_preempted_on_the_decode_side_still_finishes() -> None:
    tight = dataclasses.replace(CONFIG, kv=KVConfig(block_size=4, num_blocks=40, watermark=0.0))  # 160 tokens
    rows = [(0.0, 60, 60), (0.001, 60, 60)]
    result = simulate_cluster(trace(*rows), fleet(2, 1, decode_config=tight), inspect=check_all)
    assert any(r.num_preemptions for r in result.replicas if r.pool == "d")
    assert all(t.num_output_tokens == 60 for t in result.timelines)


def test_bytes_per_token_come_from_the_model_spec() -> None:
    roofline = PoolSpec("p", parse_cost("roofline:llama-2-7b@a100"), CONFIG, 1, role="prefill")
    assert kv_bytes_per_token(LinkConfig(), roofline) == 2 * 32 * 32 * 128 * 2  # K and V, 32 layers, fp16
    with pytest.raises(FleetError, match="kv_bytes_per_token"):
        kv_bytes_per_token(LinkConfig(), PoolSpec("p", COST, CONFIG, 1, role="prefill"))
