"""Model and device presets for the roofline cost model, with their figures and sources.

Models (shapes from each checkpoint's Hugging Face ``config.json``; parameter totals from the
model cards or the exact count of the released weights):

| preset              | params  | layers | hidden | heads/kv | head | MLP width           | vocab   |
|---------------------|---------|--------|--------|----------|------|---------------------|---------|
| llama-2-7b          | 6.74 B  | 32     | 4096   | 32/32    | 128  | 11008               | 32000   |
| llama-3-8b          | 8.03 B  | 32     | 4096   | 32/8     | 128  | 14336               | 128256  |
| qwen2-7b            | 7.62 B  | 28     | 3584   | 28/4     | 128  | 18944               | 152064  |
| llama-3-70b         | 70.6 B  | 80     | 8192   | 64/8     | 128  | 28672               | 128256  |
| mixtral-8x7b        | 46.7 B  | 32     | 4096   | 32/8     | 128  | 8 experts x 14336, top 2 | 32000 |
| qwen1.5-moe-a2.7b   | 14.3 B  | 24     | 2048   | 16/16    | 128  | 60 experts x 1408, top 4, shared 5632 | 151936 |

Sources: meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B, Qwen/Qwen2-7B,
meta-llama/Meta-Llama-3-70B, mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen1.5-MoE-A2.7B on the
Hugging Face Hub (config.json and model card); Touvron et al. 2023 (Llama 2), Jiang et al. 2024
("Mixtral of Experts": 47 B parameters, 13 B active), the Qwen team's Qwen1.5-MoE blog post
(14.3 B total, 2.7 B activated). Every preset is untied (separate LM head) and bf16 (2 bytes per
weight and per KV value). Llama-3-70B's 141 GB of weights fit only across devices:
``llama-3-70b@h100x4`` (tensor parallelism 4) is the intended use.

Devices (dense FP16/BF16 tensor-core peaks, i.e. half the "with sparsity" figures; SXM parts;
memory sizes are the datasheets' GB figures read as GiB, as the HBM stacks are, e.g. nvidia-smi
shows 81,920 MiB on an A100-80GB; link figures are one direction, half the datasheets'
bidirectional totals):

| preset | FLOP/s | memory BW  | memory  | device link (one way) | host link (one way) |
|--------|--------|------------|---------|-----------------------|---------------------|
| a100   | 312 T  | 2,039 GB/s | 80 GiB  | NVLink 3, 300 GB/s    | PCIe 4 x16, 32 GB/s |
| h100   | 989 T  | 3,350 GB/s | 80 GiB  | NVLink 4, 450 GB/s    | PCIe 5 x16, 64 GB/s |
| h200   | 989 T  | 4,800 GB/s | 141 GiB | NVLink 4, 450 GB/s    | PCIe 5 x16, 64 GB/s |
| l4     | 121 T  | 300 GB/s   | 24 GiB  | none: PCIe 4, 32 GB/s | PCIe 4 x16, 32 GB/s |

Sources: the NVIDIA datasheets of the A100 Tensor Core GPU (A100 80GB SXM column), the H100
Tensor Core GPU (H100 SXM), the H200 Tensor Core GPU (H200 SXM) and the L4 Tensor Core GPU.

Efficiencies (the same on every device; only the A100 pair was calibrated): compute 0.6 (model
FLOPs utilisation of a 512-token prefill), memory 0.75 (decode streams weights at ~1.5 TB/s on an
A100, as measured decode step times of 7B models imply), links 0.8 (nccl-tests bus bandwidth is
~75-85 % of NVLink's peak; ~25 GB/s host copies over PCIe 4). Calibration of llama-2-7b@a100
against `contbatch.sim.cost.AffineCost`'s documented anchors (with the roofline's default 0.6 ms
per-step overhead):

| step                                   | affine anchor | roofline |
|----------------------------------------|---------------|----------|
| 1 decode at 576 tokens of context      | ~9.5 ms       | 9.44 ms  |
| 32 decodes at 576 tokens of context    | ~16 ms        | 15.57 ms |
| one 512-token prefill                  | ~38 ms        | 36.39 ms |

Where it deviates: the affine model adds the weight read to the prefill's compute, the roofline
overlaps them (max), so between a decode and a ~512-token prefill the roofline is cheaper: a
128-token prefill costs ~9.5 ms in the roofline (at its ridge point) and ~16.5 ms in the affine
model; real kernels overlap partially and land in between. Long contexts cost more in the
roofline (0.5 MiB of KV per token read at 1.5 TB/s: ~0.34 us per context token, against the
affine's 0.25 us). Other devices scale by their datasheet ratios; they are not calibrated here.
"""

from __future__ import annotations

from contbatch.sim.costs.specs import GIB, DeviceSpec, ModelShape

_GB = 1e9
_T = 1e12

MODELS: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(
        name="llama-2-7b",
        num_params=6.74e9,
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
    ),
    "llama-3-8b": ModelShape(
        name="llama-3-8b",
        num_params=8.03e9,
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "qwen2-7b": ModelShape(
        name="qwen2-7b",
        num_params=7.62e9,
        num_layers=28,
        hidden_size=3584,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
    ),
    "llama-3-70b": ModelShape(
        name="llama-3-70b",
        num_params=70.6e9,
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
    ),
    "mixtral-8x7b": ModelShape(
        name="mixtral-8x7b",
        num_params=46.7e9,
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=0,
        vocab_size=32000,
        num_experts=8,
        experts_per_token=2,
        expert_intermediate_size=14336,
    ),
    "qwen1.5-moe-a2.7b": ModelShape(
        name="qwen1.5-moe-a2.7b",
        num_params=14.3e9,
        num_layers=24,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        intermediate_size=0,
        vocab_size=151936,
        num_experts=60,
        experts_per_token=4,
        expert_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
    ),
}

DEVICES: dict[str, DeviceSpec] = {
    "a100": DeviceSpec(
        name="a100",
        peak_flops=312 * _T,
        mem_bandwidth=2039 * _GB,
        mem_bytes=80 * GIB,
        link_bandwidth=300 * _GB,
        host_bandwidth=32 * _GB,
    ),
    "h100": DeviceSpec(
        name="h100",
        peak_flops=989 * _T,
        mem_bandwidth=3350 * _GB,
        mem_bytes=80 * GIB,
        link_bandwidth=450 * _GB,
        host_bandwidth=64 * _GB,
    ),
    "h200": DeviceSpec(
        name="h200",
        peak_flops=989 * _T,
        mem_bandwidth=4800 * _GB,
        mem_bytes=141 * GIB,
        link_bandwidth=450 * _GB,
        host_bandwidth=64 * _GB,
    ),
    "l4": DeviceSpec(
        name="l4",
        peak_flops=121 * _T,
        mem_bandwidth=300 * _GB,
        mem_bytes=24 * GIB,
        link_bandwidth=32 * _GB,
        host_bandwidth=32 * _GB,
    ),
}

# Other spellings accepted in specs (lower case).
DEVICE_ALIASES: dict[str, str] = {
    "a100-80gb": "a100",
    "a100-sxm": "a100",
    "h100-sxm": "h100",
    "h200-sxm": "h200",
}
MODEL_ALIASES: dict[str, str] = {
    "llama2-7b": "llama-2-7b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
    "qwen1.5-moe": "qwen1.5-moe-a2.7b",
}


def model_preset(name: str) -> ModelShape | None:
    key = name.lower()
    return MODELS.get(MODEL_ALIASES.get(key, key))


def device_preset(name: str) -> DeviceSpec | None:
    key = name.lower()
    return DEVICES.get(DEVICE_ALIASES.get(key, key))
