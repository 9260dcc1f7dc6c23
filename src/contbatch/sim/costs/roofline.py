"""The roofline cost model: a step is as slow as its FLOPs or its bytes, whichever dominates.

For one step on each of ``num_devices`` tensor-parallel devices (every quantity per device)::

    compute_s = FLOPs / (peak_flops * compute_efficiency)
    memory_s  = bytes / (mem_bandwidth * memory_efficiency)
    step_s    = max(compute_s, memory_s) + overhead + all-reduce + all-to-all + swap

- FLOPs: 2 per parameter per token for every per-layer weight a token always uses (attention
  projections, dense MLP, shared expert, router) over every batched and padding token; attention
  4 * layers * heads * head_dim per (query, key) pair, a chunk of ``n`` new tokens at ``start``
  attending causally to ``n * start + n * (n + 1) / 2`` pairs (a decode: its context); the LM head
  2 * hidden * vocab per sampled position (one per sampling prefill chunk, every new token of a
  sampling decode, every padding token); MoE experts below. Divided by ``num_devices``. Steady
  decodes a step shape leaves out of its chunks (a decode run's) are priced from its totals,
  which is exact for them; `decode_pricer` prices a step of only such decodes in fewer operations.
- Bytes: the weights once per step (all but the embedding table, whose rows are gathered; MoE:
  only the experts some token reached), the KV of every context position read by attention
  (``num_context_tokens``) and of every new token written, each device holding its share of the
  KV heads (replicated when there are fewer KV heads than devices).
- Overhead: ``overhead_ms`` per step (scheduling, kernel launches, sampling).
- All-reduce under tensor parallelism: 2 per layer (after attention and after the MLP) of
  ``batched tokens * hidden * activation bytes``, ring cost ``2 (N-1)/N * bytes / link`` plus
  ``2 (N-1)`` link latencies.
- Swap: ``num_swapped_blocks * block_size`` tokens of KV per device over the host link.

Mixture of experts: an `ExpertRouter` draws every token's experts (seeded by the step id, so a
step's cost is deterministic) and each reached expert is charged the tokens of the MOST loaded
one, as when experts run side by side and the layer waits for the slowest, or when dispatch pads
every expert to a common capacity (GShard, Switch): with balanced routing this is the ideal
``tokens * top_k`` expert FLOPs, and an imbalance of ``max / mean`` multiplies them. So two steps
with the same tokens may cost differently. Under expert parallelism (``expert_parallel == N``,
E/N whole experts per device) the MoE layer's all-reduce is replaced by two all-to-alls
(dispatch and combine), each device sending ``tokens / N * top_k * hidden * activation bytes *
(N-1)/N`` bytes (tokens assumed spread evenly over the devices). Every step's imbalance
(max load / mean load) is appended to ``stats``; `expert_load_stats` summarises it. That record
is the only state `step_time` changes, and it never feeds back into a step's cost.

Spec (parsed by `contbatch.sim.costs.roofline_spec`): ``roofline:MODEL@DEVICE[xN][,k=v...]``,
e.g. ``roofline:llama-2-7b@a100``, ``roofline:llama-3-70b@h100x4`` (tensor parallelism 4),
``roofline:mixtral-8x7b@h100x2,ep=2,router=zipf,skew=1.2``. Presets and their figures:
`contbatch.sim.costs.presets`.

`kv_blocks` sizes a KV cache like vLLM's ``gpu_memory_utilization``: the device memory times the
utilization, less the weights' share and a reserve for activations, CUDA graphs and the CUDA
context, divided by a block's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput
from contbatch.sim.costs.errors import CostSpecError, check_int, check_number
from contbatch.sim.costs.router import ExpertLoadStats, ExpertLoadSummary, ExpertRouter, imbalance
from contbatch.sim.costs.specs import GIB, DeviceSpec, ModelShape

DEFAULT_RESERVE_BYTES = 4 * GIB  # activations of a profiling run, CUDA graphs, the CUDA context


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's roofline terms, in seconds (and the per-device work behind them)."""

    compute_s: float
    memory_s: float
    overhead_s: float
    allreduce_s: float
    alltoall_s: float
    swap_s: float
    flops: float  # per device
    bytes: float  # per device
    imbalance: float = 1.0  # MoE: max expert load / mean expert load; 1.0 for a dense model

    @property
    def total_s(self) -> float:
        return _total(
            self.compute_s,
            self.memory_s,
            overhead_s=self.overhead_s,
            allreduce_s=self.allreduce_s,
            alltoall_s=self.alltoall_s,
            swap_s=self.swap_s,
        )

    @property
    def bound(self) -> str:
        """Which roof the step sits under: "compute" or "memory"."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


def _total(
    compute_s: float, memory_s: float, *, overhead_s: float, allreduce_s: float, alltoall_s: float, swap_s: float
) -> float:
    """A step's time from its terms: the one formula (`StepCost.total_s`, `RooflineCost.step_time`)."""
    return max(compute_s, memory_s) + overhead_s + allreduce_s + alltoall_s + swap_s


@dataclass(frozen=True, slots=True)
class _Constants:
    """The model's and device's figures a step's price reads, computed once per cost model (the
    same integers and floats the properties give, so prices are unchanged to the last bit)."""

    dense: int  # FLOPs factor: dense parameters per layer
    layers: int
    pair: int  # heads * head_dim, per (query, key) pair and layer
    head: int  # hidden * vocab: the LM head per position
    per_expert: int  # parameters per expert
    params: float  # weights read per step, but the embedding lookup and the routed experts
    bytes_per_value: float
    kv_per_token: float  # KV bytes per position per device
    flops_rate: float
    byte_rate: float
    overhead_s: float


class _Work(NamedTuple):  # (made for every priced step: a named tuple is cheap to make)
    tokens: int  # batched + padding
    attended: float  # (query, key) pairs of attention
    logits: int  # positions the LM head computes
    expert_slots: int  # active experts * max load (0 for a dense model)
    active_experts: int
    imbalance: float


@dataclass(frozen=True, slots=True)
class RooflineCost:
    model: ModelShape
    device: DeviceSpec
    num_devices: int = 1  # tensor-parallel degree
    expert_parallel: int = 1  # 1, or num_devices: experts spread whole over the devices (MoE only)
    overhead_ms: float = 0.6  # per step
    block_size: int = 16  # tokens per KV block, for the bytes of swapped blocks
    router: ExpertRouter = field(default_factory=ExpertRouter)  # MoE only
    stats: ExpertLoadStats = field(default_factory=ExpertLoadStats, compare=False, repr=False)
    _c: _Constants = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        m, d = self.model, self.device
        lookup = 0 if m.tie_word_embeddings else m.embedding_params
        constants = _Constants(
            dense=m.dense_params_per_layer,
            layers=m.num_layers,
            pair=m.num_heads * m.head_dim,
            head=m.hidden_size * m.vocab_size,
            per_expert=m.params_per_expert,
            params=m.num_params - lookup - m.expert_params,
            bytes_per_value=m.bytes_per_value,
            kv_per_token=m.kv_bytes_per_token(self.num_devices),
            flops_rate=d.effective_flops,
            byte_rate=d.effective_bandwidth,
            overhead_s=self.overhead_ms / 1000.0,
        )
        object.__setattr__(self, "_c", constants)
        owner = f"roofline {self.model.name}@{self.device.name}"
        check_int(owner, "num_devices", self.num_devices, minimum=1)
        check_int(owner, "expert_parallel", self.expert_parallel, minimum=1)
        check_int(owner, "block_size", self.block_size, minimum=1)
        check_number(owner, "overhead_ms", self.overhead_ms)
        if self.model.num_heads % self.num_devices:
            heads = self.model.num_heads
            raise CostSpecError(f"{owner}: {heads} attention heads cannot be split over {self.num_devices} devices")
        if self.expert_parallel > 1:
            self._check_expert_parallel(owner)
        per_device = self.model.weight_bytes / self.num_devices
        if per_device >= self.device.mem_bytes:
            fits = next((n for n in (2, 4, 8, 16, 32) if self.model.weight_bytes / n < self.device.mem_bytes), 64)
            raise CostSpecError(
                f"{owner}: {per_device / GIB:.1f} GiB of weights per device do not fit in "
                f"{self.device.mem_bytes / GIB:.0f} GiB; use more devices, e.g. @{self.device.name}x{fits}"
            )

    def _check_expert_parallel(self, owner: str) -> None:
        if not self.model.is_moe:
            raise CostSpecError(f"{owner}: expert parallelism needs a mixture-of-experts model")
        if self.expert_parallel != self.num_devices or self.model.num_experts % self.expert_parallel:
            raise CostSpecError(
                f"{owner}: expert_parallel must equal the device count ({self.num_devices}) and divide "
                f"the {self.model.num_experts} experts, got {self.expert_parallel}"
            )

    @property
    def time_unit(self) -> str:
        return "s"

    def step_time(self, out: SchedulerOutput) -> float:
        if self.model.is_moe:
            cost = self.breakdown(out)
            if cost.flops > 0:
                self.stats.record(out.step_id, cost.imbalance)
            return cost.total_s
        if self.num_devices == 1 and not (out.swapped_out or out.swapped_in):
            return self._one_device_time(out)
        work = self._work(out)
        c = self._c
        flops = self._flops(work) / self.num_devices
        return _total(
            flops / c.flops_rate,
            self._bytes(out, work) / c.byte_rate,
            overhead_s=c.overhead_s,
            allreduce_s=self._allreduce_s(work.tokens),
            alltoall_s=self._alltoall_s(work.tokens),
            swap_s=self._swap_s(out),
        )

    def _one_device_time(self, out: SchedulerOutput) -> float:
        """`step_time` of a dense model's step on one device that swaps nothing: each term as
        _work, _flops, _bytes and _total compute it, in the same operation order (no link terms;
        the zero expert terms and divisions by one dropped: exact), so the same float."""
        c = self._c
        attended, logits = _attention_and_logits(out)
        batched = out.num_batched_tokens
        tokens = batched + out.num_padding_tokens
        flops = 2.0 * tokens * c.layers * c.dense + 4.0 * c.layers * c.pair * attended + 2.0 * c.head * logits
        moved = (out.num_context_tokens + batched) * c.kv_per_token
        if tokens:
            moved = c.params * c.bytes_per_value + moved
        return max(flops / c.flops_rate, moved / c.byte_rate) + c.overhead_s

    def decode_pricer(self, num_decodes: int, num_padding: int) -> Callable[[int, int], float] | None:
        """`price(step_id, context)`: what `step_time` gives a step of `num_decodes` steady decodes
        attending to `context` positions, with `num_padding` padding tokens, computed with the
        same arithmetic in fewer operations (the simulator's decode runs call it per step).
        None for a mixture-of-experts model (its steps draw routes) or an empty step."""
        m, n, c = self.model, self.num_devices, self._c
        tokens = num_decodes + num_padding
        if m.is_moe or tokens == 0:
            return None
        # each term as _work, _flops, _bytes and _total compute it (same operation order)
        dense = 2.0 * tokens * c.layers * c.dense
        per_pair = 4.0 * c.layers * c.pair
        head = 2.0 * c.head * tokens
        experts = 2.0 * c.layers * c.per_expert * 0
        weights = (c.params + c.layers * 0 * c.per_expert) * c.bytes_per_value / n
        kv_per_token = c.kv_per_token
        flops_rate, byte_rate = c.flops_rate, c.byte_rate
        overhead, allreduce, alltoall = c.overhead_s, self._allreduce_s(tokens), self._alltoall_s(tokens)

        def price(step_id: int, context: int) -> float:
            compute = (dense + per_pair * float(context) + head + experts) / n / flops_rate
            memory = (weights + (context + num_decodes) * kv_per_token) / byte_rate
            return max(compute, memory) + overhead + allreduce + alltoall + 0.0  # _total, inlined

        return price

    def breakdown(self, out: SchedulerOutput) -> StepCost:
        """The step's roofline terms; pure (records nothing)."""
        work = self._work(out)
        c = self._c
        flops = self._flops(work) / self.num_devices
        moved = self._bytes(out, work)
        return StepCost(
            compute_s=flops / c.flops_rate,
            memory_s=moved / c.byte_rate,
            overhead_s=c.overhead_s,
            allreduce_s=self._allreduce_s(work.tokens),
            alltoall_s=self._alltoall_s(work.tokens),
            swap_s=self._swap_s(out),
            flops=flops,
            bytes=moved,
            imbalance=work.imbalance,
        )

    def expert_load_stats(self) -> ExpertLoadSummary:
        """Imbalance over the steps priced so far (MoE; an empty summary for a dense model)."""
        return self.stats.summary()

    def imbalance_history(self) -> tuple[tuple[int, float], ...]:
        """(step id, max load / mean load) of every MoE step priced so far, in order."""
        return tuple(self.stats.steps)

    def reset_stats(self) -> None:
        self.stats.clear()

    def kv_blocks(self, utilization: float = 0.9, *, reserve_bytes: float = DEFAULT_RESERVE_BYTES) -> int:
        return kv_blocks(
            self.model,
            self.device,
            self.block_size,
            utilization,
            num_devices=self.num_devices,
            reserve_bytes=reserve_bytes,
        )

    # -- the terms ---------------------------------------------------------------------------------
    def _work(self, out: SchedulerOutput) -> _Work:
        attended, logits = _attention_and_logits(out)
        tokens = out.num_batched_tokens + out.num_padding_tokens
        m = self.model
        if not m.is_moe or tokens == 0:
            return _Work(tokens, attended, logits, 0, 0, 1.0)
        loads = self.router.loads(tokens, out.step_id, m.num_experts, m.experts_per_token)
        active = sum(1 for load in loads if load)
        ratio = imbalance(loads, m.experts_per_token, tokens)
        return _Work(tokens, attended, logits, active * max(loads), active, ratio)

    def _flops(self, work: _Work) -> float:
        c = self._c
        dense = 2.0 * work.tokens * c.layers * c.dense
        attention = 4.0 * c.layers * c.pair * work.attended
        head = 2.0 * c.head * work.logits
        experts = 2.0 * c.layers * c.per_expert * work.expert_slots
        return dense + attention + head + experts

    def _bytes(self, out: SchedulerOutput, work: _Work) -> float:
        c = self._c
        kv = (out.num_context_tokens + out.num_batched_tokens) * c.kv_per_token
        if work.tokens == 0:
            return kv
        params = c.params + c.layers * work.active_experts * c.per_expert
        return params * c.bytes_per_value / self.num_devices + kv

    def _link_bandwidth(self) -> float:
        return self.device.link_bandwidth * self.device.link_efficiency

    def _allreduce_s(self, tokens: int) -> float:
        n = self.num_devices
        if n == 1 or tokens == 0:
            return 0.0
        m = self.model
        calls = m.num_layers * (1 if self.expert_parallel > 1 else 2)
        payload = tokens * m.hidden_size * m.activation_bytes
        one = 2 * (n - 1) / n * payload / self._link_bandwidth() + 2 * (n - 1) * self.device.link_latency_s
        return calls * one

    def _alltoall_s(self, tokens: int) -> float:
        n = self.expert_parallel
        if n == 1 or tokens == 0:
            return 0.0
        m = self.model
        sent = tokens / n * m.experts_per_token * m.hidden_size * m.activation_bytes * (n - 1) / n
        one = sent / self._link_bandwidth() + self.device.link_latency_s
        return 2 * m.num_layers * one

    def _swap_s(self, out: SchedulerOutput) -> float:
        if not out.swapped_out and not out.swapped_in:
            return 0.0
        moved = out.num_swapped_blocks * self.block_size * self._c.kv_per_token
        return moved / (self.device.host_bandwidth * self.device.link_efficiency)


def _attention_and_logits(out: SchedulerOutput) -> tuple[float, int]:
    """(query, key) pairs attention computes and positions the LM head computes.

    A chunk of k tokens from position s attends to k * s + k * (k + 1) / 2 pairs and, when it
    samples, computes 1 logit row (a prefill) or k (a decode). Steady decodes a step shape leaves
    out of its chunks (a decode run's, `contbatch.sim.decode_run`) are priced from the totals:
    each attends to its context and samples one token, which is exact for them. A shape without
    chunks is all such decodes.

    The pairs are summed in integers: every term is a non-negative integer, so while the total is
    below 2**53 each partial sum of the float sum in chunk order is exact, and the integer sum
    converts to the same float (above that, that float sum itself).
    """
    if not out.chunks:
        return float(out.num_context_tokens), out.num_decode_tokens + out.num_padding_tokens
    pairs = 0
    logits = out.num_padding_tokens + out.num_omitted_decodes
    for _, start, k, is_prefill, samples in out.chunks:
        if k == 1:  # a decode, or a one-token prefill chunk
            pairs += start + 1
            logits += samples
        else:
            pairs += k * start + k * (k + 1) // 2
            if samples:
                logits += 1 if is_prefill else k
    attended = float(pairs) if pairs < _EXACT else _float_pairs(out.chunks)
    if out.num_omitted_decodes:
        attended += out.num_context_tokens - sum(c.start + c.num_new_tokens for c in out.chunks)
    return attended, logits


_EXACT = 1 << 53  # integers below this are exact as floats


def _float_pairs(chunks: tuple[ScheduledChunk, ...]) -> float:
    attended = 0.0
    for c in chunks:
        k = c.num_new_tokens
        attended += k * c.start + k * (k + 1) / 2
    return attended


def kv_blocks(
    model: ModelShape,
    device: DeviceSpec,
    block_size: int = 16,
    utilization: float = 0.9,
    *,
    num_devices: int = 1,
    reserve_bytes: float = DEFAULT_RESERVE_BYTES,
) -> int:
    """KV blocks of ``block_size`` tokens each device can hold (what ``kv.num_blocks`` should be).

    ``device.mem_bytes * utilization - weights / num_devices - reserve_bytes``, over the bytes of
    one block on one device. CostSpecError when nothing is left for the KV cache.
    """
    check_int("kv_blocks", "block_size", block_size, minimum=1)
    check_int("kv_blocks", "num_devices", num_devices, minimum=1)
    check_number("kv_blocks", "utilization", utilization, exclusive=True)
    check_number("kv_blocks", "reserve_bytes", reserve_bytes)
    if utilization > 1:
        raise CostSpecError(f"kv_blocks: utilization must be in (0, 1], got {utilization!r}")
    free = device.mem_bytes * utilization - model.weight_bytes / num_devices - reserve_bytes
    blocks = math.floor(free / (block_size * model.kv_bytes_per_token(num_devices)))
    if blocks < 1:
        raise CostSpecError(
            f"kv_blocks: {model.name} on {num_devices} x {device.name} at utilization {utilization:g} leaves "
            f"{free / GIB:.1f} GiB for the KV cache: no room for one block"
        )
    return blocks
