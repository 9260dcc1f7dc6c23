"""Matrix products against weights laid out once, at load, for the device's fastest kernel.

`pack_weight(w, device, dtype)` turns a transformers weight [out, in] into the operand `linear`
reads, and `linear(x, packed, bias)` is `x @ w.T + bias` on it. The layouts (`PACKERS`; the one
`weight_layout` picks):

- `panels`, float32 on a CPU whose native kernels run with AVX2 and FMA (`contbatch.engine.native`,
  `gemm.c`): columns in panels of 16, a 1-D tensor of out x in floats, multiplied by the native
  kernel, tiles of 6 rows x 16 columns in registers (with AVX-512, 14 rows x two panels). On the
  demo model's shapes it runs near the machine's matmul peak, 1.1-2 x oneDNN's packed product at
  8-2,048 rows and 2-3 x at one row on AVX2 CPUs (a row through the LM head: as fast as MKL's
  matrix-vector product from a plain copy, which this layout does not keep); on an AVX-512 CPU
  1.0-1.3 x at 32 rows, 0.9-0.95 x at 2,048.
- `onednn`, float32 on a CPU build with oneDNN elsewhere: the weight reordered once into oneDNN's
  blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, an opaque mkldnn tensor of logical
  shape [out, in]) and multiplied by `torch.ops.mkldnn._linear_pointwise`, as torch inductor's
  CPU path does. MKL's sgemm, handed a plain matrix, repacks it on every call; at decode batch
  sizes that repacking is a large part of the time of a wide matrix such as the LM head. One row
  is a matrix-vector product that MKL streams from the plain matrix 30-50 % faster than oneDNN's
  kernel (`LlamaModel` keeps a plain copy of its head for that case, with this layout only).
- `transposed`, anything else (CUDA, float16/bfloat16, a build without oneDNN): a contiguous
  transposed copy [in, out], multiplied as `x @ w_t` (`addmm` with a bias), which streams faster
  than `F.linear`.

Invariants: `packed.numel()` is the weight's element count in every layout; `linear` returns a
new contiguous [rows, out] tensor in x's dtype, equal to `F.linear(x, w, bias)` up to float32
rounding (the kernels sum in different orders).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from contbatch.engine import native


def onednn_packing(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed product is available for `device` and `dtype` (module docstring)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def weight_layout(device: torch.device, dtype: torch.dtype) -> str:
    """The fastest layout of `PACKERS` for `device` and `dtype` (module docstring). For the CPU in
    float32 asking builds (or finds off) the native kernels: at load, not in the first step."""
    if device.type == "cpu" and dtype == torch.float32 and native.panel_packing():
        return "panels"
    return "onednn" if onednn_packing(device, dtype) else "transposed"


def _onednn(weight: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return packed


PACKERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "panels": lambda weight: native.pack_panels(weight.contiguous()),
    "onednn": _onednn,
    "transposed": lambda weight: weight.t().contiguous(),
}


def pack_weight(
    weight: torch.Tensor, device: torch.device, dtype: torch.dtype, layout: str | None = None
) -> torch.Tensor:
    """`weight` [out, in] as `linear`'s operand on `device` in `dtype`, in `layout` (default:
    `weight_layout`'s choice)."""
    return PACKERS[layout or weight_layout(device, dtype)](weight.to(device=device, dtype=dtype))


def in_panels(packed: torch.Tensor) -> bool:
    """Whether `packed` is in the `panels` layout (the only 1-D one)."""
    return packed.dim() == 1


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x` [rows, in] times the weight `pack_weight` laid out, plus `bias` [out] when given."""
    if in_panels(packed):
        out = native.panel_product(x, packed)
        return out if bias is None else out.add_(bias)
    if packed.is_mkldnn:
        result: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return result
    return x @ packed if bias is None else torch.addmm(bias, x, packed)


def gated_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up where [gate | up] = `linear(x, packed, bias)` (a gated MLP's fused gate and
    up projections): in one native pass, the product never in memory, for a panel-packed weight
    without bias (`native.gated_panel_product`); else the product, then `native.silu_mul` (the
    same bits), or torch's silu written over the gate (a large temporary fewer)."""
    if bias is None and in_panels(packed):
        activated = native.gated_panel_product(x, packed)
        if activated is not None:
            return activated
    gate_up = linear(x, packed, bias)
    activated = native.silu_mul(gate_up)
    if activated is None:
        gate, up = gate_up.chunk(2, dim=-1)
        activated = F.silu(gate).mul_(up)
    return activated
