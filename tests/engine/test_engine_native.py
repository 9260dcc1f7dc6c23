"""The native kernels (`contbatch.engine.native`): decode and prefill attention equal to the torch
path on the shapes the engine runs, and off, with the torch path in its place, wherever they
cannot be built or used."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contbatch.engine import attention, native
from contbatch.engine.attention import AttentionMetadata, ChunkLayout, build_metadata, paged_attention, windowed
from contbatch.engine.native import (
    FLAGS,
    add_rms_norm,
    gated_panel_product,
    load_library,
    pack_panels,
    paged_decode,
    paged_prefill,
    panel_product,
    rotate_in_place,
    silu_mul,
)
from contbatch.engine.rope import apply_rotary

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not Path("/proc/self/maps").exists(),
    reason="no C compiler, or not Linux: the kernel is off (the torch path is tested everywhere)",
)


def _step(
    num_heads: int, num_kv_heads: int, head_dim: int, *, block_size: int, rows: int, seed: int
) -> tuple[list[ChunkLayout], torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Decode rows of random contexts over shuffled blocks of a head-major cache, with q, k, v cut
    from one projection as the model cuts them (q's rows strided)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = rows * (300 // block_size + 2)
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim).permute(0, 2, 3, 1, 4)
    free = list(range(num_blocks))
    rng.shuffle(free)
    layouts = []
    for i, start in enumerate(sorted(rng.randrange(0, 300) for _ in range(rows))):
        layouts.append(ChunkLayout(i, 1, start, [free.pop() for _ in range(start // block_size + 1)]))
    qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim)
    q, k, v = torch.split(qkv, [num_heads, num_kv_heads, num_kv_heads], dim=1)
    return layouts, q, k, v, (cache[0], cache[1])


# each build of the kernels but this CPU's own: the flags added to FLAGS
OTHER_BUILDS = {"AVX2": ("-mno-avx512f",), "portable": ("-DCONTBATCH_NATIVE_PORTABLE",)}


def _has_avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text()


@pytest.fixture(params=["this CPU", "AVX2", "portable"])
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each build of the kernels in turn: for this CPU (the decode attention's AVX-512 loops for head
    dims that are multiples of 16 where the CPU has them, its AVX2 loops for other multiples of 8),
    for this CPU without AVX-512 (the AVX2 loops alone, what AVX2 machines run: tile16 and its
    prefetches, the attention's 8-wide loops; only where this CPU has AVX-512, else it is the
    first), and its portable loops alone (what other CPUs run), put in its place."""
    if request.param == "AVX2" and not _has_avx512():
        pytest.skip("this CPU has no AVX-512: its own build is the AVX2 one")
    if request.param in OTHER_BUILDS:
        other = load_library((*FLAGS, *OTHER_BUILDS[request.param]))
        monkeypatch.setattr(native, "native_library", lambda: other)
    return str(request.param)


def _in_place_and_gathered(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention through the kernel, and through the torch path (the kernel patched off)."""
    in_place = paged_attention(*qkv, (cache[0].clone(), cache[1].clone()), meta, scale=scale)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "paged_decode", lambda *args, **kwargs: False)
        gathered = paged_attention(*qkv, cache, meta, scale=scale)
    return in_place, gathered


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (32, 8), (12, 1), (8, 8)])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (80, 1), (128, 32), (40, 16), (6, 4)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.usefixtures("kernel_build")
def test_the_kernel_equals_the_torch_path(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    assert native.native_library() is not None, "a C compiler is here: the kernel must build"
    layouts, q, k, v, cache = _step(
        num_heads, num_kv_heads, head_dim, block_size=block_size, rows=24, seed=head_dim + num_heads
    )
    meta = windowed(build_metadata(layouts, range(24), block_size=block_size, device=torch.device("cpu")), window)
    assert len(meta.decode_groups) >= 2 or window is not None  # (contexts 1-300 split the rows into groups)
    in_place, gathered = _in_place_and_gathered((q, k, v), cache, meta, head_dim**-0.5)
    torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_build")
def test_peaked_scores_keep_their_weights() -> None:
    """Scores a hundred and more apart: exp underflows (the kernel's exponential clamps below -87),
    yet every row's output matches the torch path's, which rounds those weights to 0. (Scores of
    about +-100 carry float32 rounding near 1e-5 in any order of summation: 1e-4 here.)"""
    layouts, q, k, v, cache = _step(6, 2, 64, block_size=16, rows=24, seed=3)
    meta = build_metadata(layouts, range(24), block_size=16, device=torch.device("cpu"))
    in_place, gathered = _in_place_and_gathered((q * 40.0, k, v), cache, meta, 0.125)
    torch.testing.assert_close(in_place, gathered, atol=1e-4, rtol=1e-4)


def _prefill_step(
    num_heads: int, num_kv_heads: int, head_dim: int, *, block_size: int, seed: int
) -> tuple[list[ChunkLayout], tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Prefill chunks (whole prompts, and later chunks over a cached prefix; lengths around the
    kernel's tile of 8 positions) and decodes in one flat batch, over shuffled blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    spans = [(0, 37), (5, 2), (0, 1), (100, 9), (0, 8), (61, 1), (16, 70)]  # (start, tokens)
    num_blocks = sum((start + n) // block_size + 1 for start, n in spans) + 4
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim).permute(0, 2, 3, 1, 4)
    free = list(range(num_blocks))
    rng.shuffle(free)
    layouts, begin = [], 0
    for start, n in spans:
        layouts.append(ChunkLayout(begin, n, start, [free.pop() for _ in range((start + n - 1) // block_size + 1)]))
        begin += n
    qkv = torch.randn(begin, num_heads + 2 * num_kv_heads, head_dim)
    q, k, v = torch.split(qkv, [num_heads, num_kv_heads, num_kv_heads], dim=1)
    return layouts, (q, k, v), (cache[0], cache[1])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (32, 8), (12, 1), (8, 8)])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (80, 1), (128, 32), (6, 4)])
@pytest.mark.usefixtures("kernel_build")
def test_prefill_chunks_in_place_equal_the_torch_path(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    layouts, (q, k, v), cache = _prefill_step(num_heads, num_kv_heads, head_dim, block_size=block_size, seed=head_dim)
    meta = build_metadata(layouts, range(q.shape[0]), block_size=block_size, device=torch.device("cpu"))
    assert all(p.block_ids is not None for p in meta.prefills) and len(meta.prefills) == 5
    chunk = meta.prefills[0]  # the kernel reads it (no silent torch path)
    out = torch.empty(chunk.num_tokens, num_heads, head_dim)
    assert paged_prefill(q[: chunk.num_tokens], *cache, block_ids=chunk.block_ids, start=0, scale=0.1, out=out)
    in_place = paged_attention(q, k, v, (cache[0].clone(), cache[1].clone()), meta, scale=head_dim**-0.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "paged_prefill", lambda *args, **kwargs: False)
        gathered = paged_attention(q, k, v, cache, meta, scale=head_dim**-0.5)
    torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)


def test_prefill_refuses_a_table_too_short_and_tensors_it_does_not_read() -> None:
    _, (q, _, _), cache = _prefill_step(6, 2, 64, block_size=16, seed=0)
    out = torch.empty(37, 6, 64)
    with pytest.raises(ValueError, match="cannot hold"):
        paged_prefill(q[:37], *cache, block_ids=torch.tensor([0, 1]), start=0, scale=0.1, out=out)
    assert not paged_prefill(q[:37].double(), *cache, block_ids=torch.tensor([0, 1, 2]), start=0, scale=0.1, out=out)


@pytest.mark.parametrize("rows", [1, 7, 300])  # (300 x 384 elements: split over the threads)
@pytest.mark.parametrize("width", [384, 100, 3])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_residual_add_then_llama_rms_norm(rows: int, width: int, with_delta: bool) -> None:
    torch.manual_seed(rows + width)
    h, delta, weight = torch.randn(rows, width) * 3, torch.randn(rows, width), torch.rand(width) + 0.5
    expected_h = h + delta if with_delta else h.clone()
    variance = expected_h.pow(2).mean(-1, keepdim=True)  # transformers' LlamaRMSNorm, float32
    expected = weight * (expected_h * torch.rsqrt(variance + 1e-6))
    out = add_rms_norm(h, delta if with_delta else None, weight, 1e-6)
    assert out is not None
    torch.testing.assert_close(h, expected_h, atol=0, rtol=0)  # the add is exact, in place
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 200])  # (200 x 512 elements: split over the threads)
def test_silu_mul_is_the_gated_activation(rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 1024) * 6
    gate_up[0, :6] = torch.tensor([-100.0, -87.5, -20.0, 0.0, 20.0, 100.0])  # (exp under- and overflow)
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_mul(gate_up)
    assert out is not None
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("out_features", "in_features"), [(640, 384), (6160, 384), (100, 40), (16, 1), (5, 7)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 13, 16, 32, 300, 1500])
@pytest.mark.usefixtures("kernel_build")
def test_panel_product_is_the_matrix_product(out_features: int, in_features: int, rows: int) -> None:
    """Full panels of 16 columns and a narrower last one, pairs of panels and an odd one left; row
    tiles of 6 (AVX2) or 14 (AVX-512) and every remainder; 1,500 rows of 384 inputs: three row
    blocks; a weight of 9 MiB (over `STREAMED_WEIGHT_BYTES`: each pair's first tile prefetches
    the next pair, but the last whole one, which the odd panel follows); every build (`kernel_build`)."""
    torch.manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features) * in_features**-0.5  # (outputs of about 1, as a model's)
    x = torch.randn(rows, in_features)
    packed = pack_panels(weight)
    assert packed.shape == (out_features * in_features,)
    torch.testing.assert_close(panel_product(x, packed), x @ weight.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("out_features", "in_features"), [(32000, 64), (100, 40), (16, 3), (5, 7)])
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
@pytest.mark.usefixtures("kernel_build")
def test_panel_product_argmax_follows_torch_argmax(out_features: int, in_features: int, rows: int) -> None:
    """Each row's first maximum, as `torch.argmax` on the product it returns: random rows, rows whose
    maximum repeats in several panels (the lowest column wins, whichever thread computed it), rows
    of -inf and 0 (ties everywhere), and rows with NaN (the first NaN wins)."""
    torch.manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features)
    weight[out_features // 2 :: 7] = weight[out_features // 3]  # a column repeated across panels
    x = torch.randn(rows, in_features)
    x[0] = 0.0  # every product 0: column 0
    if rows > 2:
        x[1, 0] = float("-inf")  # -inf or NaN (0 x -inf) or +inf across the row
        x[2, 0] = float("nan")  # every product NaN: column 0
    argmax = torch.full((rows,), -7, dtype=torch.long)
    out = panel_product(x, pack_panels(weight), argmax=argmax)
    assert argmax.tolist() == out.argmax(dim=-1).tolist()


def test_panel_product_refuses_what_does_not_fit() -> None:
    packed = pack_panels(torch.randn(8, 6))
    for x in (torch.randn(3, 5), torch.randn(3, 6).double(), torch.randn(3, 0)):
        with pytest.raises(ValueError, match="does not fit a panel-packed weight"):
            panel_product(x, packed)
    with pytest.raises(ValueError, match="contiguous float32"):
        pack_panels(torch.randn(6, 8).t())
    for argmax in (torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="argmax must be"):
            panel_product(torch.randn(3, 6), packed, argmax=argmax)


@pytest.mark.parametrize(("half", "in_features"), [(1024, 384), (96, 40), (32, 1)])
@pytest.mark.parametrize("rows", [1, 5, 14, 15, 300, 1500])
@pytest.mark.usefixtures("kernel_build")
def test_gated_product_gives_silu_mul_of_the_products_bits(half: int, in_features: int, rows: int) -> None:
    """silu(gate) * up from the gate and up columns as they leave the products (`gemm_gated`) is
    `silu_mul(panel_product(...))` bit for bit: one pair of panels (32 columns each side) and
    many, row tiles and their remainders, 1,500 rows of 384 inputs (three row blocks), a strided
    x; every build."""
    torch.manual_seed(half + rows)
    weight = torch.randn(2 * half, in_features) * in_features**-0.5
    x = torch.randn(rows, 2 * in_features)[:, ::2]
    packed = pack_panels(weight)
    out = gated_panel_product(x, packed)
    assert out is not None and out.shape == (rows, half) and out.stride() == (half + 16 * (half % 512 == 0), 1)
    assert torch.equal(out, silu_mul(panel_product(x, packed)))


def test_gated_product_declines_what_its_pairs_do_not_cover() -> None:
    """Half widths that are not a multiple of 32 (the caller then multiplies and applies silu
    itself), and refuses x that does not fit, as panel_product does."""
    for half in (16, 48, 8):
        assert gated_panel_product(torch.randn(3, 40), pack_panels(torch.randn(2 * half, 40))) is None
    packed = pack_panels(torch.randn(64, 40))
    for x in (torch.randn(3, 41), torch.randn(3, 40).double(), torch.randn(3, 0)):
        with pytest.raises(ValueError, match="does not fit a panel-packed weight"):
            gated_panel_product(x, packed)


@pytest.mark.parametrize("rows", [1, 7, 300])  # (300 x 8 heads x 64: split over the threads)
@pytest.mark.parametrize("head_dim", [64, 6])
def test_rotate_in_place_gives_apply_rotarys_bits(rows: int, head_dim: int) -> None:
    """The q and k heads of a fused projection's output (a strided view: v's columns after them
    are left alone), rotated in place to the bits of the torch path (each product rounded)."""
    torch.manual_seed(rows + head_dim)
    qkv = torch.randn(rows, 10 * head_dim) * 3
    before = qkv.clone()
    x = qkv[:, : 8 * head_dim].view(rows, 8, head_dim)
    angles = torch.rand(rows, head_dim // 2) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = apply_rotary(x, cos, sin)
    assert rotate_in_place(x, cos, sin)
    assert torch.equal(x, expected)
    assert torch.equal(qkv[:, 8 * head_dim :], before[:, 8 * head_dim :])


def test_rotate_in_place_leaves_what_it_does_not_read_to_torch() -> None:
    x, cos = torch.randn(4, 2, 8), torch.randn(4, 8)
    before = x.clone()
    for args in (
        (x.double(), cos.double(), cos.double()),  # another dtype
        (x.transpose(1, 2), cos, cos),  # heads not contiguous
        (x, cos[:3], cos[:3]),  # a row short
        (x, cos.t().contiguous().t(), cos.t().contiguous().t()),  # cos's rows strided
        (x[:1].expand(4, 2, 8), cos, cos),  # rows that overlap
        (torch.randn(4, 2, 7), torch.randn(4, 7), torch.randn(4, 7)),  # an odd head_dim
    ):
        assert not rotate_in_place(*args)
    assert torch.equal(x, before)


def test_fused_kernels_leave_what_they_do_not_read_to_torch() -> None:
    h, weight = torch.randn(4, 8), torch.ones(8)
    before = h.clone()
    for args in ((h.double(), None, weight.double()), (h.t(), None, torch.ones(4)), (h, torch.ones(4, 7), weight)):
        assert add_rms_norm(*args, 1e-6) is None  # type: ignore[arg-type]
    assert add_rms_norm(h, torch.ones(4, 8), torch.ones(7), 1e-6) is None
    assert torch.equal(h, before)
    assert silu_mul(torch.randn(4, 7)) is None  # (odd width)
    assert silu_mul(torch.randn(4, 8).t()) is None
    assert silu_mul(torch.randn(2, 4, 8)) is None


def test_tensors_it_does_not_read_are_left_to_the_torch_path() -> None:
    layouts, q, _, _, (keys, values) = _step(6, 2, 64, block_size=16, rows=4, seed=0)
    g = build_metadata(layouts, range(4), block_size=16, device=torch.device("cpu")).decode_groups[0]
    out = torch.full((g.token_end - g.token_begin, 6, 64), 7.0)
    rows = slice(g.token_begin, g.token_end)
    where = {"block_ids": g.block_ids, "lo": g.key_lo, "hi": g.key_hi, "scale": 0.125, "out": out}
    for args in ((q[rows].double(), keys.double(), values.double()), (q[rows].transpose(1, 2), keys, values)):
        assert not paged_decode(*args, **where)  # type: ignore[arg-type]
    assert bool((out == 7.0).all())
    assert paged_decode(q[rows], keys, values, **where)  # type: ignore[arg-type]


_PROBE = """
import json, logging
import torch
from contbatch.engine.native import native_library

class Kept(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())

warnings = []
logging.getLogger("contbatch.engine.native").addHandler(Kept())
print(json.dumps({"on": native_library() is not None, "warnings": warnings}))
"""


def _probe(tmp_path: Path, **env: str) -> dict[str, object]:
    environ = {k: v for k, v in os.environ.items() if k not in ("CC", "CONTBATCH_NATIVE")}
    environ |= {"XDG_CACHE_HOME": str(tmp_path), **env}
    cmd = [sys.executable, "-c", _PROBE]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=environ)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_built_once_then_loaded_from_the_cache_without_a_compiler(tmp_path: Path) -> None:
    assert _probe(tmp_path) == {"on": True, "warnings": []}
    assert [p.suffix for p in (tmp_path / "contbatch" / "native").iterdir()] == [".so"]  # (no temporary left)
    assert _probe(tmp_path, CC="/bin/false") == {"on": True, "warnings": []}


def test_off_with_one_warning_when_it_cannot_be_built_or_when_told(tmp_path: Path) -> None:
    failed = _probe(tmp_path, CC="/bin/false")
    assert failed["on"] is False
    assert len(failed["warnings"]) == 1 and "/bin/false failed" in failed["warnings"][0]  # type: ignore[arg-type,index]
    missing = _probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert missing["on"] is False and "did not run" in missing["warnings"][0]  # type: ignore[index]
    assert _probe(tmp_path, CONTBATCH_NATIVE="0") == {"on": False, "warnings": []}
