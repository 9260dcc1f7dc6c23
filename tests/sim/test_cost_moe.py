"""Mixture of experts in the roofline model: seeded routing, the most loaded expert's time, the
imbalance record, expert parallelism's all-to-all."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.sim.cost import CostSpecError, parse_cost
from contbatch.sim.costs import ExpertRouter, RooflineCost


def prefill_step(step_id: int, tokens: int) -> SchedulerOutput:
    return build_output(step_id, [ScheduledChunk("p", 0, tokens, True, True)])


def decode_step(step_id: int, batch: int, context: int = 500) -> SchedulerOutput:
    return build_output(step_id, [ScheduledChunk(f"r{i}", context - 1, 1, False, True) for i in range(batch)])


def roofline(spec: str) -> RooflineCost:
    cost = parse_cost(f"roofline:{spec}")
    assert isinstance(cost, RooflineCost)
    return cost


# -- the router -------------------------------------------------------------------------------------
@settings(max_examples=3 * settings().max_examples // 5, deadline=None)
@given(
    kind=st.sampled_from(["uniform", "zipf", "dirichlet"]),
    tokens=st.integers(0, 300),
    experts_k=st.sampled_from([(8, 2), (60, 4), (4, 4), (16, 1)]),
    step_id=st.integers(0, 10**6),
    skew=st.floats(0.05, 3.0),
)
def test_router_loads_are_valid_and_deterministic(
    kind: str, tokens: int, experts_k: tuple[int, int], step_id: int, skew: float
) -> None:
    experts, k = experts_k
    router = ExpertRouter(kind, skew, seed=7)
    loads = router.loads(tokens, step_id, experts, k)
    assert len(loads) == experts and sum(loads) == tokens * k
    assert all(0 <= load <= tokens for load in loads)  # a token reaches k distinct experts
    assert router.loads(tokens, step_id, experts, k) == loads  # keyed by the step id alone


def test_router_depends_on_seed_and_step() -> None:
    router = ExpertRouter()
    assert router.loads(64, 1, 8, 2) != router.loads(64, 2, 8, 2)
    assert ExpertRouter(seed=1).loads(64, 1, 8, 2) != router.loads(64, 1, 8, 2)


def test_skewed_routers_are_less_balanced_than_uniform() -> None:
    def mean_max(router: ExpertRouter) -> float:
        return sum(max(router.loads(512, s, 8, 2)) for s in range(20)) / 20

    uniform = mean_max(ExpertRouter())
    assert 128 <= uniform < 150  # mean load 512 * 2 / 8 = 128
    assert mean_max(ExpertRouter("zipf", 1.5)) > 1.5 * uniform
    assert mean_max(ExpertRouter("dirichlet", 0.2)) > 1.5 * uniform
    assert mean_max(ExpertRouter("dirichlet", 1000.0)) < 1.1 * uniform  # large concentration: near uniform


def test_router_rejects_bad_settings() -> None:
    with pytest.raises(CostSpecError, match="kind"):
        ExpertRouter("random")
    with pytest.raises(CostSpecError, match="skew"):
        ExpertRouter("dirichlet", 0.0)


# -- step costs -------------------------------------------------------------------------------------
def test_moe_step_costs_are_deterministic_for_a_sequence_of_steps() -> None:
    steps = [prefill_step(0, 700), decode_step(1, 40), decode_step(2, 39), prefill_step(3, 2048)]
    a, b = roofline("mixtral-8x7b@h100x2,router=zipf"), roofline("mixtral-8x7b@h100x2,router=zipf")
    times = [a.step_time(s) for s in steps]
    assert [b.step_time(s) for s in steps] == times
    assert [a.step_time(s) for s in steps] == times  # pricing again: same times (only the record grows)
    assert len(a.imbalance_history()) == 8


def test_imbalance_raises_step_time_at_equal_tokens() -> None:
    step = prefill_step(5, 4096)  # compute-bound: the experts' FLOPs decide
    uniform = roofline("mixtral-8x7b@h100x2")
    skewed = roofline("mixtral-8x7b@h100x2,router=zipf,skew=1.5")
    u, s = uniform.breakdown(step), skewed.breakdown(step)
    assert u.bound == s.bound == "compute"
    assert s.imbalance > 2 * u.imbalance
    assert skewed.step_time(step) > 1.5 * uniform.step_time(step)
    # same model, same tokens, different routing draws: different times
    times = {uniform.step_time(prefill_step(i, 1024)) for i in range(10)}
    assert len(times) > 1


def test_balanced_routing_costs_the_ideal_active_flops() -> None:
    """With a uniform router and many tokens the padded expert work is close to tokens * top_k."""
    cost = roofline("mixtral-8x7b@a100x2")
    step = cost.breakdown(prefill_step(0, 16384))
    assert 1.0 <= step.imbalance < 1.05
    m = cost.model
    dense = 2 * 16384 * m.num_layers * m.dense_params_per_layer
    ideal_experts = 2 * 16384 * m.experts_per_token * m.num_layers * m.params_per_expert
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * 16384 * 16385 / 2
    head = 2 * m.hidden_size * m.vocab_size
    ideal = (dense + ideal_experts + attention + head) / 2
    assert ideal <= step.flops < 1.05 * ideal


def test_a_small_batch_reads_only_the_experts_it_reaches() -> None:
    cost = roofline("mixtral-8x7b@h100x2")
    one = cost.breakdown(decode_step(0, 1, context=10))  # 2 experts of 8 per layer
    many = cost.breakdown(decode_step(0, 256, context=10))  # every expert
    m = cost.model
    assert one.bytes < (m.active_params * 2 / 2) * 1.02
    assert many.bytes > (m.num_params - m.embedding_params) * 2 / 2 * 0.99
    assert one.imbalance == pytest.approx(m.num_experts / m.experts_per_token)  # 1 token: max 1, mean 1/4


def test_stats_record_every_priced_step() -> None:
    cost = roofline("qwen1.5-moe-a2.7b@a100,router=dirichlet,skew=0.5")
    assert cost.expert_load_stats().num_steps == 0
    for i in range(5):
        cost.step_time(decode_step(i, 64))
    summary = cost.expert_load_stats()
    history = cost.imbalance_history()
    assert summary.num_steps == 5 and [s for s, _ in history] == [0, 1, 2, 3, 4]
    assert 1.0 <= summary.mean_imbalance <= summary.max_imbalance <= 60 / 4
    assert summary.max_imbalance == max(v for _, v in history)
    cost.reset_stats()
    assert cost.imbalance_history() == ()
    dense = roofline("llama-3-8b@a100")
    dense.step_time(decode_step(0, 8))
    assert dense.expert_load_stats().num_steps == 0  # nothing to route


def test_stats_do_not_change_equality() -> None:
    a, b = roofline("mixtral-8x7b@h100x2"), roofline("mixtral-8x7b@h100x2")
    a.step_time(decode_step(0, 8))
    assert a == b and hash(a) == hash(b)


def test_expert_parallelism_swaps_the_moe_all_reduce_for_all_to_alls() -> None:
    step = prefill_step(0, 2048)
    tp, ep = roofline("mixtral-8x7b@h100x4"), roofline("mixtral-8x7b@h100x4,ep=4")
    a, b = tp.breakdown(step), ep.breakdown(step)
    assert a.alltoall_s == 0 and b.alltoall_s > 0
    assert b.allreduce_s == pytest.approx(a.allreduce_s / 2)  # attention's all-reduce stays
    assert a.compute_s == pytest.approx(b.compute_s)
    m = ep.model
    sent = 2048 / 4 * m.experts_per_token * m.hidden_size * 2 * 3 / 4
    assert b.alltoall_s == pytest.approx(2 * m.num_layers * (sent / (0.8 * 450e9) + 2e-6))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mixtral-8x7b@h100x4,ep=2", "expert_parallel"),
        ("qwen1.5-moe-a2.7b@h100x8,ep=8", "expert_parallel"),  # 60 experts over 8
        ("llama-3-8b@h100x2,ep=2", "mixture-of-experts"),
        ("llama-3-8b@h100,router=zipf", "mixture-of-experts"),
        ("mixtral-8x7b@h100x2,router=hot", "router"),
        ("mixtral-8x7b@h100x2,router=dirichlet,skew=0", "skew"),
        ("mixtral-8x7b@h100x2,seed=-1", "seed"),
    ],
)
def test_moe_spec_errors(spec: str, message: str) -> None:
    with pytest.raises(CostSpecError, match=message):
        parse_cost(f"roofline:{spec}")
