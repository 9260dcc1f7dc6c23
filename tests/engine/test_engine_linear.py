"""`pack_weight` + `linear` is `F.linear` for any number of rows, in both layouts: oneDNN-packed
(float32 on a CPU build with oneDNN) and the plain transposed matrix (anything else)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from contbatch.engine.linear import linear, onednn_packing, pack_weight

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [0, 1, 3, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=g, dtype=dtype)  # [out, in]
    bias = torch.randn(48, generator=g, dtype=dtype) if with_bias else None
    x = torch.randn(rows, 40, generator=g, dtype=dtype)
    packed = pack_weight(weight, CPU, dtype)
    assert packed.is_mkldnn == onednn_packing(CPU, dtype) and packed.numel() == weight.numel()
    out = linear(x, packed, bias)
    assert out.shape == (rows, 48) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_linear_reads_strided_rows() -> None:
    """A column slice of a wider activation (as `o.view(...)` or a chunked projection gives)."""
    weight = torch.randn(16, 24)
    x = torch.randn(5, 48)[:, ::2]
    torch.testing.assert_close(linear(x, pack_weight(weight, CPU, torch.float32)), F.linear(x, weight))


def test_packing_is_cpu_float32_only() -> None:
    assert not onednn_packing(CPU, torch.float64)
    assert not onednn_packing(torch.device("cuda", 0), torch.float32)
