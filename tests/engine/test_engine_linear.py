"""`pack_weight` + `linear` is `F.linear` for any number of rows, in every layout: the native
kernels' column panels and oneDNN-packed (float32 on the CPU, where each is available) and the
plain transposed matrix (anything else)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from contbatch.engine import native
from contbatch.engine.linear import PACKERS, gated_linear, linear, onednn_packing, pack_weight, weight_layout

CPU = torch.device("cpu")


def _available(layout: str, dtype: torch.dtype) -> bool:
    if layout == "transposed":
        return True
    if dtype != torch.float32:
        return False
    return native.native_library() is not None if layout == "panels" else onednn_packing(CPU, dtype)


@pytest.mark.parametrize("layout", sorted(PACKERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [0, 1, 3, 6, 7, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_f_linear(layout: str, dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    if not _available(layout, dtype):
        pytest.skip(f"no {layout} layout for {dtype} here")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(56, 40, generator=g, dtype=dtype)  # [out, in]: three panels of 16 and one of 8
    bias = torch.randn(56, generator=g, dtype=dtype) if with_bias else None
    x = torch.randn(rows, 40, generator=g, dtype=dtype)
    packed = pack_weight(weight, CPU, dtype, layout)
    assert packed.numel() == weight.numel()
    out = linear(x, packed, bias)
    assert out.shape == (rows, 56) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(PACKERS))
@pytest.mark.parametrize("half", [32, 24])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_linear_is_silu_of_the_gate_times_up(layout: str, half: int, with_bias: bool) -> None:
    """In every layout, with a bias or without, half widths the native gated product covers (32)
    and those it leaves to the product and silu after (24)."""
    if not _available(layout, torch.float32):
        pytest.skip(f"no {layout} layout here")
    g = torch.Generator().manual_seed(half)
    weight = torch.randn(2 * half, 40, generator=g) * 40**-0.5
    bias = torch.randn(2 * half, generator=g) if with_bias else None
    x = torch.randn(7, 40, generator=g)
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    out = gated_linear(x, pack_weight(weight, CPU, torch.float32, layout), bias)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(PACKERS))
def test_linear_reads_strided_rows(layout: str) -> None:
    """A column slice of a wider activation (as `o.view(...)` or a chunked projection gives)."""
    if not _available(layout, torch.float32):
        pytest.skip(f"no {layout} layout here")
    weight = torch.randn(16, 24)
    x = torch.randn(5, 48)[:, ::2]
    torch.testing.assert_close(linear(x, pack_weight(weight, CPU, torch.float32, layout)), F.linear(x, weight))


def test_the_layout_is_the_fastest_available() -> None:
    assert weight_layout(CPU, torch.float64) == "transposed"
    assert weight_layout(torch.device("cuda", 0), torch.float32) == "transposed"
    expected = "panels" if native.panel_packing() else "onednn" if onednn_packing(CPU, torch.float32) else "transposed"
    assert weight_layout(CPU, torch.float32) == expected


def test_packing_is_cpu_float32_only() -> None:
    assert not onednn_packing(CPU, torch.float64)
    assert not onednn_packing(torch.device("cuda", 0), torch.float32)
