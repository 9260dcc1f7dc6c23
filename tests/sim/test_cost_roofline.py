"""The roofline cost model: preset figures, monotonicity, the two roofs, tensor parallelism, swaps,
KV sizing, and the Llama-2-7B@A100 calibration against the affine model's documented anchors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from contbatch.core.config import KVConfig, SchedulerConfig
from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.sim import simulate
from contbatch.sim.cost import CostSpecError, parse_cost
from contbatch.sim.costs import DEVICES, MODELS, DeviceSpec, ModelShape, RooflineCost, kv_blocks
from contbatch.sim.costs.specs import GIB
from contbatch.traces import Trace, TraceRequest


def decode(rid: str, context: int) -> ScheduledChunk:
    return ScheduledChunk(rid, context - 1, 1, False, True)


def prefill(rid: str, tokens: int, start: int = 0) -> ScheduledChunk:
    return ScheduledChunk(rid, start, tokens, True, True)


def out(chunks: list[ScheduledChunk], **kw: object) -> SchedulerOutput:
    return build_output(0, chunks, **kw)  # type: ignore[arg-type]


def decodes(n: int, context: int) -> SchedulerOutput:
    return out([decode(f"r{i}", context) for i in range(n)])


def roofline(spec: str) -> RooflineCost:
    cost = parse_cost(f"roofline:{spec}")
    assert isinstance(cost, RooflineCost)
    return cost


LLAMA_A100 = roofline("llama-2-7b@a100")


# -- presets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_shapes_reproduce_the_published_parameter_counts(name: str) -> None:
    model = MODELS[name]
    assert model.derived_params == pytest.approx(model.num_params, rel=0.01)


def test_moe_presets_active_parameters_match_the_published_figures() -> None:
    assert MODELS["mixtral-8x7b"].active_params == pytest.approx(12.9e9, rel=0.02)  # "13B active"
    assert MODELS["qwen1.5-moe-a2.7b"].active_params == pytest.approx(2.7e9, rel=0.02)
    assert not MODELS["llama-3-8b"].is_moe and MODELS["llama-3-8b"].active_params == MODELS["llama-3-8b"].num_params


def test_kv_bytes_per_token_follow_grouped_query_attention() -> None:
    assert MODELS["llama-2-7b"].kv_bytes_per_token() == 512 * 1024  # 2 * 32 layers * 4096 * 2 bytes
    assert MODELS["llama-3-8b"].kv_bytes_per_token() == 128 * 1024  # 8 KV heads of 32
    assert MODELS["llama-3-70b"].kv_bytes_per_token(4) == MODELS["llama-3-70b"].kv_bytes_per_token() / 4
    # fewer KV heads than devices: each device keeps a replica of one head
    assert MODELS["qwen2-7b"].kv_bytes_per_token(8) == MODELS["qwen2-7b"].kv_bytes_per_token(4)


def test_device_presets_datasheet_figures() -> None:
    a100, h100, h200, l4 = DEVICES["a100"], DEVICES["h100"], DEVICES["h200"], DEVICES["l4"]
    assert (a100.peak_flops, a100.mem_bandwidth, a100.mem_bytes) == (312e12, 2039e9, 80 * GIB)
    assert (h100.peak_flops, h100.mem_bandwidth) == (989e12, 3350e9)
    assert (h200.mem_bandwidth, h200.mem_bytes) == (4800e9, 141 * GIB)
    assert (l4.peak_flops, l4.mem_bandwidth, l4.mem_bytes) == (121e12, 300e9, 24 * GIB)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("device", sorted(DEVICES))
def test_every_preset_pair_that_fits_prices_steps(model: str, device: str) -> None:
    spec = MODELS[model]
    count = next(n for n in (1, 2, 4, 8) if spec.weight_bytes / n < DEVICES[device].mem_bytes * 0.8)
    cost = roofline(f"{model}@{device}x{count}")
    assert cost.time_unit == "s"
    small, big = cost.step_time(decodes(1, 100)), cost.step_time(out([prefill("p", 4096)]))
    assert 0 < small < big < 10.0


# -- the calibration anchors --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("step", "target_ms"),
    [(decodes(1, 576), 9.5), (decodes(32, 576), 16.0), (out([prefill("p", 512)]), 38.0)],
    ids=["1-decode", "32-decodes", "512-prefill"],
)
def test_llama_2_7b_on_a100_lands_near_the_affine_anchors(step: SchedulerOutput, target_ms: float) -> None:
    assert LLAMA_A100.step_time(step) * 1000 == pytest.approx(target_ms, rel=0.05)  # documented: within 5 %
    assert LLAMA_A100.step_time(step) * 1000 == pytest.approx(target_ms, rel=0.25)  # the brief's tolerance


# -- shape of the model -----------------------------------------------------------------------------
def test_monotonic_in_tokens_and_context() -> None:
    cost = LLAMA_A100
    by_batch = [cost.step_time(decodes(n, 1000)) for n in (1, 2, 8, 32, 128, 256)]
    by_context = [cost.step_time(decodes(16, c)) for c in (1, 128, 1024, 4096, 16384)]
    by_prompt = [cost.step_time(out([prefill("p", n)])) for n in (1, 16, 128, 512, 2048, 8192)]
    for series in (by_batch, by_context, by_prompt):
        assert series == sorted(series) and len(set(series)) == len(series)


def test_a_decode_is_memory_bound_and_a_big_prefill_compute_bound() -> None:
    step = LLAMA_A100.breakdown(decodes(8, 1000))
    assert step.bound == "memory" and step.memory_s > 5 * step.compute_s
    big = LLAMA_A100.breakdown(out([prefill("p", 4096)]))
    assert big.bound == "compute" and big.compute_s > 5 * big.memory_s
    assert big.total_s == pytest.approx(big.compute_s + big.overhead_s)


def test_prefill_attention_grows_quadratically_with_a_chunk() -> None:
    """The second 2048-token chunk of a prompt attends to the first: it costs more than the first."""
    first = LLAMA_A100.breakdown(out([prefill("p", 2048)]))
    second = LLAMA_A100.breakdown(out([prefill("p", 2048, start=2048)]))
    assert second.flops > first.flops
    pairs = 2048 * 2048  # the extra (query, key) pairs
    assert second.flops - first.flops == pytest.approx(4 * 32 * 4096 * pairs)


def test_decode_weights_dominate_then_kv() -> None:
    """One decode reads the weights once (~13.2 GB, the embedding table aside) plus its KV."""
    step = LLAMA_A100.breakdown(decodes(1, 576))
    weights = (6.74e9 - 32000 * 4096) * 2
    assert step.bytes == pytest.approx(weights + 577 * 512 * 1024)


def test_tensor_parallelism_cuts_compute_and_memory_but_adds_all_reduce() -> None:
    one, four = roofline("llama-3-8b@h100"), roofline("llama-3-8b@h100x4")
    big = out([prefill("p", 4096)])
    a, b = one.breakdown(big), four.breakdown(big)
    assert b.compute_s == pytest.approx(a.compute_s / 4)
    assert b.memory_s < a.memory_s / 3
    assert a.allreduce_s == 0 and b.allreduce_s > 0
    # ring: 2 per layer of 4096 tokens * 4096 * 2 bytes, moving 2 * 3/4 of it over 0.8 * 450 GB/s
    payload = 4096 * 4096 * 2
    expected = 2 * 32 * (1.5 * payload / (0.8 * 450e9) + 6 * 2e-6)
    assert b.allreduce_s == pytest.approx(expected)
    assert four.step_time(big) < one.step_time(big)


def test_llama_3_70b_needs_tensor_parallelism() -> None:
    with pytest.raises(CostSpecError, match=r"do not fit.*h100x2"):
        roofline("llama-3-70b@h100")
    cost = roofline("llama-3-70b@h100x4")
    assert cost.num_devices == 4
    step = cost.breakdown(decodes(1, 576))
    assert step.allreduce_s > 0 and step.bound == "memory"
    assert 10e-3 < step.total_s < 30e-3  # ~35 GB of weights per device at ~2.5 TB/s, plus all-reduces


def test_heads_must_split_over_the_devices() -> None:
    with pytest.raises(CostSpecError, match="heads"):
        roofline("qwen2-7b@h100x8")  # 28 heads


def test_swaps_cost_block_bytes_over_the_host_link() -> None:
    base = out([decode("a", 100)])
    swapped = out([decode("a", 100)], swapped_in=(("b", (1, 2, 3, 4)),))
    extra = LLAMA_A100.step_time(swapped) - LLAMA_A100.step_time(base)
    block = 16 * 512 * 1024  # 8 MiB
    assert extra == pytest.approx(4 * block / (32e9 * 0.8))
    assert 0.25e-3 < extra / 4 < 0.45e-3  # ~ AffineCost's 0.32 ms per block


def test_padding_tokens_are_priced_as_work() -> None:
    base = out([prefill("p", 1000)])
    padded = out([prefill("p", 1000)], num_padding_tokens=1000)
    assert LLAMA_A100.breakdown(padded).flops > 1.9 * LLAMA_A100.breakdown(base).flops


def test_a_chunkless_decode_shape_costs_the_same_as_its_chunks() -> None:
    """Decode spans (contbatch.core.span) price step shapes without chunks from their totals."""
    full = decodes(24, 700)
    shape = SchedulerOutput(
        full.step_id, (), full.num_batched_tokens, 0, full.num_decode_tokens, full.num_context_tokens, num_requests=24
    )
    assert LLAMA_A100.step_time(shape) == pytest.approx(LLAMA_A100.step_time(full), rel=1e-12)


def test_specs_validate_their_fields() -> None:
    with pytest.raises(CostSpecError, match="num_kv_heads"):
        dataclasses.replace(MODELS["llama-3-8b"], num_kv_heads=5)
    with pytest.raises(CostSpecError, match="experts_per_token"):
        dataclasses.replace(MODELS["mixtral-8x7b"], experts_per_token=9)
    with pytest.raises(CostSpecError, match="compute_efficiency"):
        dataclasses.replace(DEVICES["a100"], compute_efficiency=1.5)
    with pytest.raises(CostSpecError, match="peak_flops"):
        dataclasses.replace(DEVICES["a100"], peak_flops=math.nan)
    assert isinstance(MODELS["llama-2-7b"], ModelShape) and isinstance(DEVICES["l4"], DeviceSpec)


# -- KV sizing --------------------------------------------------------------------------------------
def test_kv_blocks_llama_2_7b_on_a100_is_about_100k_tokens() -> None:
    blocks = kv_blocks(MODELS["llama-2-7b"], DEVICES["a100"], 16, 0.9)
    assert 90_000 <= blocks * 16 <= 130_000
    assert blocks == LLAMA_A100.kv_blocks(0.9)
    # the arithmetic: 0.9 * 80 GiB - 13.48 GB of weights - 4 GiB reserve, in 8 MiB blocks
    assert blocks == math.floor((0.9 * 80 * GIB - 6.74e9 * 2 - 4 * GIB) / (16 * 512 * 1024))


def test_kv_blocks_scale_sensibly() -> None:
    llama, a100 = MODELS["llama-2-7b"], DEVICES["a100"]
    assert kv_blocks(llama, a100, 16, 0.5) < kv_blocks(llama, a100, 16, 0.9)
    assert kv_blocks(llama, a100, 32, 0.9) == pytest.approx(kv_blocks(llama, a100, 16, 0.9) / 2, abs=1)
    assert kv_blocks(MODELS["llama-3-8b"], a100) > 3 * kv_blocks(llama, a100)  # 4x smaller KV (GQA)
    assert kv_blocks(llama, DEVICES["h200"]) > 1.9 * kv_blocks(llama, a100)  # 141 GiB against 80
    tp4 = kv_blocks(MODELS["llama-3-70b"], DEVICES["h100"], num_devices=4)
    assert 300_000 < tp4 * 16 < 600_000  # per-device blocks, each holding 2 of the 8 KV heads (80 KiB a token)
    with pytest.raises(CostSpecError, match="no room"):
        kv_blocks(MODELS["llama-3-8b"], DEVICES["l4"], utilization=0.5)
    with pytest.raises(CostSpecError, match="utilization"):
        kv_blocks(llama, a100, utilization=1.5)


def test_a_simulation_with_the_roofline_and_a_sized_kv_cache() -> None:
    cost = roofline("llama-3-8b@h100")
    kv = KVConfig(block_size=16, num_blocks=cost.kv_blocks())
    requests = [TraceRequest(f"r{i}", i * 0.05, 256 + 97 * i % 700, 20 + 13 * i % 90) for i in range(40)]
    trace = Trace("t", tuple(requests), "s", "test")
    result = simulate(trace, ContinuousScheduler(SchedulerConfig(kv=kv)), cost)
    assert result.time_unit == "s"
    assert all(t.finish_reason is not None for t in result.timelines)
    assert 0 < result.busy_time < 60


def test_attention_pairs_equal_the_float_sum_in_chunk_order() -> None:
    """The integer sum of (query, key) pairs gives the float the per-chunk float sum gives, below
    2**53 and above it (then it is that sum), and the logit rows count each sampling chunk."""
    import random

    from contbatch.sim.costs.roofline import _attention_and_logits

    def reference(step: SchedulerOutput) -> tuple[float, int]:
        attended, listed, logits = 0.0, 0, step.num_padding_tokens + step.num_omitted_decodes
        for c in step.chunks:
            k = c.num_new_tokens
            attended += k * c.start + k * (k + 1) / 2
            listed += c.start + k
            if c.samples:
                logits += 1 if c.is_prefill else k
        if step.num_omitted_decodes:
            attended += step.num_context_tokens - listed
        return attended, logits

    rng = random.Random(7)
    for trial in range(300):
        scale = 1 << rng.choice((4, 12, 20, 40, 52, 60))  # the last ones cross 2**53
        sizes = (1, 1, 1, 2, 7, 2048)
        chunks = [
            ScheduledChunk(f"r{i}", rng.randrange(scale), rng.choice(sizes), rng.random() < 0.3, rng.random() < 0.8)
            for i in range(rng.randrange(1, 60))
        ]
        step = build_output(trial, chunks, num_padding_tokens=rng.randrange(3))
        if trial % 3 == 0:  # a decode run's arrival step: steady decodes left out of the chunks
            omitted = rng.randrange(1, 40)
            step = dataclasses.replace(
                step,
                num_batched_tokens=step.num_batched_tokens + omitted,
                num_decode_tokens=step.num_decode_tokens + omitted,
                num_context_tokens=step.num_context_tokens + omitted * rng.randrange(1, scale),
                num_omitted_decodes=omitted,
            )
        assert _attention_and_logits(step) == reference(step)


@pytest.mark.parametrize("spec", ["llama-2-7b@a100", "llama-3-8b@h100", "llama-2-7b@a100x2"])
def test_a_step_costs_its_breakdowns_total_to_the_last_bit(spec: str) -> None:
    """`step_time` (a shortcut for one device) gives the float of `breakdown(...).total_s`, which
    computes every term, for random shapes: prefills, decodes, padding, chunkless decodes."""
    import random

    cost = roofline(spec)
    rng = random.Random(11)
    for trial in range(300):
        chunks = [
            ScheduledChunk(f"r{i}", rng.randrange(4096), rng.choice((1, 1, 3, 512, 4000)), rng.random() < 0.4, True)
            for i in range(rng.randrange(0, 40))
        ]
        step = build_output(trial, chunks, num_padding_tokens=rng.randrange(5))
        if not chunks:
            n = rng.randrange(0, 64)
            step = dataclasses.replace(
                step, num_batched_tokens=n, num_decode_tokens=n, num_context_tokens=n * rng.randrange(1, 3000)
            )
        assert cost.step_time(step) == cost.breakdown(step).total_s, step
        if not chunks and step.num_batched_tokens + step.num_padding_tokens:  # a decode run's price of it
            price = cost.decode_pricer(step.num_decode_tokens, step.num_padding_tokens)
            assert price is not None
            assert price(trial, step.num_context_tokens) == cost.breakdown(step).total_s, step
