"""The native decode kernel (`contbatch.engine.native`): equal to the torch path on the shapes the
engine runs, and off, with the torch path in its place, wherever it cannot be built or used."""

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
from contbatch.engine.native import FLAGS, decode_kernel, load_kernel, paged_decode

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


@pytest.fixture(params=["this CPU", "portable"])
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each build of the kernel in turn: for this CPU (its AVX2 loops here, for head dims that are
    multiples of 8), and its portable loops alone (what other CPUs run), put in its place."""
    if request.param == "portable":
        portable = load_kernel((*FLAGS, "-DPAGED_DECODE_PORTABLE"))
        monkeypatch.setattr(native, "decode_kernel", lambda: portable)
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
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (80, 1), (128, 32), (6, 4)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.usefixtures("kernel_build")
def test_the_kernel_equals_the_torch_path(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    assert decode_kernel() is not None, "a C compiler is here: the kernel must build"
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
from contbatch.engine.native import decode_kernel

class Kept(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())

warnings = []
logging.getLogger("contbatch.engine.native").addHandler(Kept())
print(json.dumps({"on": decode_kernel() is not None, "warnings": warnings}))
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
