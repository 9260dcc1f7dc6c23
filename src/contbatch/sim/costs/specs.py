"""What a roofline cost model knows about a model and a device: two frozen dataclasses.

`ModelShape` is a decoder-only transformer as its Hugging Face ``config.json`` describes it:
layers, hidden size, attention heads and KV heads (grouped-query attention), head dimension,
the SwiGLU MLP's intermediate size (three matrices: gate, up, down), vocabulary, and for a
mixture of experts the number of routed experts, experts per token, their intermediate size and
an always-active shared expert. Sizes derived from it (parameters per layer, KV bytes per token)
are properties, so they cannot disagree with the fields. ``num_params`` is the published total,
used for the weights' memory; `derived_params` recomputes it from the shapes (tests check the two
agree within ~1 %, which validates each preset's shape fields). It is the roofline's arithmetic
model of a transformer, not a checkpoint: the engine's `contbatch.engine.spec.ModelSpec` describes
a checkpoint it loads.

`DeviceSpec` is one accelerator as its datasheet describes it (dense FP16/BF16 tensor FLOP/s,
memory bandwidth and capacity, device-to-device and host links), plus the fractions of the peaks
that real kernels reach (``compute_efficiency``, ``memory_efficiency``, ``link_efficiency``).

Units: FLOP/s, bytes, bytes/s and seconds throughout. Invariants (checked on construction, as a
`CostSpecError` naming the field): counts are positive integers (MoE counts may be 0 for a dense
model, and then all are 0), ``experts_per_token <= num_experts``, ``num_kv_heads`` divides
``num_heads``; rates and sizes are finite and > 0; efficiencies are in (0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contbatch.sim.costs.errors import CostSpecError, check_int, check_number

GIB = 2**30


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_params: float  # published total parameter count (all experts included)
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (== num_heads without grouped-query attention)
    head_dim: int
    intermediate_size: int  # dense SwiGLU MLP width; 0 for a model whose every layer is MoE
    vocab_size: int
    bytes_per_value: float = 2.0  # weights: 2 for fp16/bf16, 1 for fp8/int8
    kv_bytes_per_value: float = 2.0  # KV cache entries
    activation_bytes: float = 2.0  # activations exchanged by collectives (bf16)
    tie_word_embeddings: bool = False  # the LM head reuses the embedding table
    num_experts: int = 0  # routed experts per MoE layer; 0: dense model
    experts_per_token: int = 0  # top-k
    expert_intermediate_size: int = 0  # each routed expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # an always-active expert's width (0: none)

    def __post_init__(self) -> None:
        owner = f"model {self.name!r}"
        check_number(owner, "num_params", self.num_params, exclusive=True)
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            check_int(owner, name, getattr(self, name), minimum=1)
        for name in ("bytes_per_value", "kv_bytes_per_value", "activation_bytes"):
            check_number(owner, name, getattr(self, name), exclusive=True)
        moe = ("num_experts", "experts_per_token", "expert_intermediate_size", "shared_expert_intermediate_size")
        for name in ("intermediate_size", *moe):
            check_int(owner, name, getattr(self, name), minimum=0)
        if self.num_heads % self.num_kv_heads:
            raise CostSpecError(f"{owner}: num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.is_moe and not (1 <= self.experts_per_token <= self.num_experts and self.expert_intermediate_size):
            raise CostSpecError(
                f"{owner}: a MoE model needs 1 <= experts_per_token <= num_experts and expert_intermediate_size > 0"
            )
        if not self.is_moe and (self.experts_per_token or self.expert_intermediate_size):
            raise CostSpecError(f"{owner}: experts_per_token and expert_intermediate_size need num_experts > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params_per_layer(self) -> int:
        """Q, K, V and output projections (biases ignored)."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q_width + 2 * kv_width)

    @property
    def dense_params_per_layer(self) -> int:
        """Every per-layer weight a token always uses: attention, dense MLP, shared expert, router."""
        h = self.hidden_size
        mlp = 3 * h * (self.intermediate_size + self.shared_expert_intermediate_size)
        return self.attention_params_per_layer + mlp + h * self.num_experts

    @property
    def params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def expert_params(self) -> int:
        """All routed experts of all layers."""
        return self.num_layers * self.num_experts * self.params_per_expert

    @property
    def derived_params(self) -> int:
        """The total recomputed from the shapes (norms and biases ignored)."""
        heads = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return heads + self.num_layers * self.dense_params_per_layer + self.expert_params

    @property
    def active_params(self) -> float:
        """Parameters one token uses: everything but the unused experts (and the embedding lookup)."""
        active_experts = self.num_layers * self.experts_per_token * self.params_per_expert
        return self.num_params - self.expert_params + active_experts

    @property
    def weight_bytes(self) -> float:
        """Resident weights: every parameter, all experts included."""
        return self.num_params * self.bytes_per_value

    def kv_heads_per_device(self, num_devices: int) -> int:
        """KV heads one of ``num_devices`` tensor-parallel devices holds (replicated when fewer heads than devices)."""
        return math.ceil(self.num_kv_heads / num_devices)

    def kv_bytes_per_token(self, num_devices: int = 1) -> float:
        """KV cache bytes one token position occupies on one device (K and V, every layer)."""
        return 2 * self.num_layers * self.kv_heads_per_device(num_devices) * self.head_dim * self.kv_bytes_per_value


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense FP16/BF16 tensor-core FLOP/s (not the 2:4-sparsity figure)
    mem_bandwidth: float  # device memory bytes/s
    mem_bytes: float  # device memory capacity, bytes
    link_bandwidth: float  # device-to-device bytes/s, one direction (NVLink; PCIe without it)
    host_bandwidth: float  # device-to-host bytes/s, one direction (PCIe)
    compute_efficiency: float = 0.6  # fraction of peak_flops dense GEMMs reach
    memory_efficiency: float = 0.75  # fraction of mem_bandwidth streaming reads reach
    link_efficiency: float = 0.8  # fraction of link and host bandwidth collectives and copies reach
    link_latency_s: float = 2e-6  # per ring step of an all-reduce, per all-to-all

    def __post_init__(self) -> None:
        owner = f"device {self.name!r}"
        for name in ("peak_flops", "mem_bandwidth", "mem_bytes", "link_bandwidth", "host_bandwidth"):
            check_number(owner, name, getattr(self, name), exclusive=True)
        for name in ("compute_efficiency", "memory_efficiency", "link_efficiency"):
            value = getattr(self, name)
            check_number(owner, name, value, exclusive=True)
            if value > 1:
                raise CostSpecError(f"{owner}: {name} must be in (0, 1], got {value!r}")
        check_number(owner, "link_latency_s", self.link_latency_s)

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_bandwidth(self) -> float:
        return self.mem_bandwidth * self.memory_efficiency
