"""A greedy step's LM head read in bfloat16, giving float32's tokens exactly.

A greedy step keeps only each row's argmax of h . W^T, and W (the LM head) is the decode step's
largest read. `ArgmaxHead` keeps W rounded to bfloat16 beside W itself and, with
`contbatch.engine.native.argmax_bf16`, finds each row's argmax as the float32 panel product does
(`panel_product(argmax=...)`): every approximate logit is within

    e_v = BOUND * ||h||_2 * ||W_v||_2  (+ an absolute term for subnormals, far below it)

of the float32 kernel's, BOUND = ((1 + u)^r - 1 + 2 gamma_K (1 + u)^r) * 1.01: u = 2^-8, the
rounding to bfloat16 (to nearest) of the r operands the kernel rounds; gamma_K = K 2^-24 /
(1 - K 2^-24), each side's float32 sum of K products; Cauchy-Schwarz for the sum of |h_k| |W_vk|;
1 % for the rounding of the bound itself. A column whose approximate logit plus e is below the
row's largest approximate logit minus e cannot be float32's argmax; the others are summed again
in float32 exactly as the panel product sums them, so the argmax and its first-column tie rule
are the float32 kernel's, bit for bit.

Two kernels (`native.BF16_ARGMAX_KERNELS`), the fastest that runs here by default: "tiles" (AMX's
tile unit; h rounded too, r = 2: about twice the candidates, and the product no longer bound by
the vector units' multiply-adds: 32 rows cost the head's bytes alone) and "vectors" (AVX-512;
h in float32, r = 1). `benchmarks/lm_head_bound.py` measures the candidates a row (on the demo
model 2 at the median with h in float32, 3 with h rounded) and how close the error comes to the
bound (a tenth of it).

Built only where a kernel runs (`native.argmax_bf16_kernels`: the kernels' AVX-512 build), for a
head whose row count is a multiple of 32 and whose weights are all finite. Rows the kernel leaves
to float32 (-1: h not finite or too large, too many candidates) are taken by the panel product.
Memory: the bfloat16 copy (half of W) and W kept in plain rows (the candidates' sums read whole
rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contbatch.engine import native
from contbatch.engine.linear import in_panels

_U = 2.0**-8  # bfloat16's unit roundoff


def bound_for(width: int, rounded_operands: int = 1) -> float:
    """BOUND of the module docstring for sums of `width` products, the weight rounded to bfloat16
    (`rounded_operands` 2: h too, as `vdpbf16ps` takes it; `benchmarks/lm_head_bound.py`)."""
    gamma = width * 2.0**-24 / (1 - width * 2.0**-24)
    rounding = (1 + _U) ** rounded_operands
    return (rounding - 1 + 2 * gamma * rounding) * 1.01


@dataclass(frozen=True, slots=True)
class ArgmaxHead:
    """The LM head's bfloat16 panels, its float32 rows and their norms (module docstring)."""

    kernel: str  # one of `native.BF16_ARGMAX_KERNELS`
    head16: torch.Tensor  # int16: `native.pack_head_bf16` for that kernel
    rows32: torch.Tensor  # float32 [N, K]
    norms: torch.Tensor  # float32 [N]
    max_norm: float
    bound: float

    @classmethod
    def build(cls, head: torch.Tensor, packed: torch.Tensor, kernel: str | None = None) -> ArgmaxHead | None:
        """For `head` [N, K] (float32 on the CPU) whose float32 operand `packed` is in panels, with
        `kernel` (default: the fastest that runs here); None where none runs or it cannot be exact
        (module docstring)."""
        kernels = native.argmax_bf16_kernels()
        chosen = kernel or (kernels[0] if kernels else None)
        if (
            chosen not in kernels
            or not in_panels(packed)
            or head.dtype != torch.float32
            or head.device.type != "cpu"
            or head.shape[0] % 32
            or not bool(torch.isfinite(head).all())
        ):
            return None
        rows32 = head.contiguous()
        norms = rows32.norm(dim=1)
        head16 = native.pack_head_bf16(rows32, chosen)
        rounded = native.BF16_ARGMAX_KERNELS[chosen].rounded_operands
        return cls(chosen, head16, rows32, norms, float(norms.max()), bound_for(head.shape[1], rounded))

    def argmax(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Each row's float32 argmax into `out` (int64 [rows]); the rows the kernel left to float32
        (-1), as an index tensor (empty: none, the step's usual case, found without a pass over out)."""
        left = native.argmax_bf16(
            h,
            self.head16,
            self.norms,
            self.rows32,
            kernel=self.kernel,
            bound=self.bound,
            max_norm=self.max_norm,
            out=out,
        )
        return (out < 0).nonzero().flatten() if left else out.new_empty(0)
