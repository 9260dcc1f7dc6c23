"""Matrix products against weights laid out once, at load, for the device's fastest kernel.

`pack_weight(w, device, dtype)` turns a transformers weight [out, in] into the operand `linear`
reads, and `linear(x, packed, bias)` is `x @ w.T + bias` on it:

- float32 on a CPU build with oneDNN: the weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, an opaque mkldnn tensor of logical shape [out, in])
  and multiplied by `torch.ops.mkldnn._linear_pointwise`, as torch inductor's CPU path does. MKL's
  sgemm, handed a plain matrix, repacks it on every call; at decode batch sizes that repacking is
  a large part of the time of a wide matrix such as the LM head (the demo model's head, 2 threads:
  about 7 ms against 13 ms for 32 rows, 3.7 ms against 8.8 ms for 8). The layout holds for any
  number of rows, but one row is a matrix-vector product that MKL streams from the plain matrix
  30-50 % faster than oneDNN's kernel (`LlamaModel` keeps a plain copy of its head for that case).
- anything else (CUDA, float16/bfloat16, a build without oneDNN): a contiguous transposed copy
  [in, out], multiplied as `x @ w_t` (`addmm` with a bias), which streams faster than `F.linear`.

Invariants: `packed.numel()` is the weight's element count in both layouts; `linear` returns a
new contiguous [rows, out] tensor in x's dtype, equal to `F.linear(x, w, bias)` up to float32
rounding (the kernels sum in different orders).
"""

from __future__ import annotations

import torch


def onednn_packing(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights for `device` and `dtype` are packed for oneDNN (see the module docstring)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`weight` [out, in] as `linear`'s operand on `device` in `dtype`."""
    w = weight.to(device=device, dtype=dtype)
    if onednn_packing(device, dtype):
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        return packed
    return w.t().contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x` [rows, in] times the weight `pack_weight` laid out, plus `bias` [out] when given."""
    if packed.is_mkldnn:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out
    return x @ packed if bias is None else torch.addmm(bias, x, packed)
