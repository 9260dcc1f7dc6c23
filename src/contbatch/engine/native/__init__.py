"""The engine's native CPU kernels: decode attention read in place from the paged KV cache, the
decoder layer's elementwise steps fused, and matrix products against weights packed in panels.

- `paged_decode` (`paged_decode.c`): the torch path of `contbatch.engine.attention` copies every
  decode row's keys and values out of their blocks (one gather per layer), pads the rows to the
  longest and masks the rest, then runs scaled-dot-product attention; the kernel reads each key
  and value once where it lies, each row over its own keys only. On a CPU with AVX2 and FMA its
  inner loops are vector code written for them (eight keys' scores at a time); elsewhere, and in
  the build `load_library` makes with `-DCONTBATCH_NATIVE_PORTABLE`, plain loops that the compiler
  vectorises. `paged_prefill` (the same source) is the causal attention of a prefill chunk, read
  in place as well: its queries eight positions at a time, the tile's query heads of one KV head
  sharing one pass over the keys (torch's flash attention for the CPU takes its causal blocks at
  about 55-75 GFLOP/s here; this about 90-100). On a CPU with AVX-512 a tile is as many positions
  as fill 32 rows (its query heads of one KV head), each row a vector lane of the scores, every
  key element broadcast to all the rows, eight keys at a time; the weighted values are summed
  by the decode's loops, six rows at a time (about 190 GFLOP/s on the demo model's shapes with
  two threads, 1.3 x the lanes kernel before the twenty-second session).
- `add_rms_norm`, `silu_mul`, `rotate_in_place` (`fused.c`): the residual add with the next
  RMSNorm, the gated MLP's silu(gate) * up, and the rotary embedding of the q and k heads (in
  place, in the projection's output), each one pass over the rows instead of torch's four to
  seven operations (at a decode step's few rows, their dispatch is most of their cost; at a
  prefill's thousands, their passes over memory and their temporaries).
- `pack_panels`, `panel_product` (`gemm.c`): weights in 16-column panels and their product, the
  `panels` layout of `contbatch.engine.linear` where `panel_packing()` says it is the faster
  (AVX2 and FMA; with AVX-512, two panels at a time in 512-bit registers);
  `gated_panel_product`: a gated MLP's silu(gate) * up applied as the gate and up columns leave
  the product (`silu_mul`'s bits, the [rows, 2 n] product never in memory), into rows laid out
  by `activation_rows` so that the next product reads them without L1 conflicts.
- `argmax_bf16` (`gemm.c`, AVX-512 builds): each row's argmax of a product as `panel_product`
  finds it in float32, exactly, from the weight rounded to bfloat16 (`pack_head_bf16`): half the
  bytes streamed; the few columns the rounding's bound cannot rule out are summed again in
  float32 (`contbatch.engine.argmax_head.ArgmaxHead`). Two kernels: AVX-512's vector units, and
  on CPUs with AMX its tile unit (x rounded to bfloat16 too), which multiplies fast enough that
  the product waits on memory alone.

They are C compiled on first use by the machine's compiler (`$CC`, else `cc`) with `FLAGS`
(`-O3 -march=native -fopenmp`, ...) into one library, called through ctypes. `native_library()`
gives it, or None, and the engine keeps its torch paths, when: CONTBATCH_NATIVE=0 is set; the
process's OpenMP runtime is not the libgomp that torch runs on (the kernels' threads must be
torch's own: a second runtime's would spin beside them, as two OpenMP teams did in the server
before, `contbatch.engine.serving`); there is no compiler, or the build fails (logged once).
Each wrapper returns False or None, leaving its inputs alone, for tensors its kernel does not
read (another dtype or device, another layout): the caller's torch path runs. The library is
cached under $XDG_CACHE_HOME/contbatch/native (default ~/.cache), named by a hash of the
sources, the flags and the CPU's model and flags (it is built for this CPU), and loaded from
there without a compiler; it is written under a temporary name and renamed, so that processes
starting at once never load a half-written file.

Invariant: each kernel's output equals its torch path's to float32 rounding (different summation
orders, an exponential within about 1 ulp; `tests/engine/test_engine_native.py` holds both
builds within 1e-5 on every attention shape the engine runs: grouped-query, multi-query and
multi-head, windows, rows of different contexts; the fused steps against transformers'
formulas; the panel product against torch's).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from contbatch.engine.host_memory import huge_page_empty

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "paged_decode.c", HERE / "fused.c", HERE / "gemm.c", HERE / "tiles.c")  # built into one library
HEADERS = (HERE / "exp_nonpositive.h", HERE / "silu.h", HERE / "tiles.h")
# -fno-trapping-math: no floating-point operation here traps, and the compiler may then vectorise
# the exponential (its clamp is a comparison)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fPIC", "-shared")

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# each function's parameters, in order (the C sources), and its result
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "paged_decode": (
        [
            _PTR, _I64,  # q, q_stride_row
            _PTR, _PTR, _PTR, _I64,  # key_cache, value_cache, tables, W
            _PTR, _PTR,  # lo, hi
            _I64, _I64, _I64, _I64, _I64,  # B, Hq, Hkv, D, bs
            _I64, _I64, _I64,  # stride_block, stride_offset, stride_head
            _F32, _PTR, _INT,  # scale, out, num_threads
        ],
        _INT,
    ),
    "paged_prefill": (
        [
            _PTR, _I64,  # q, q_stride_row
            _PTR, _PTR, _PTR,  # key_cache, value_cache, table
            _I64, _I64, _I64, _I64, _I64, _I64,  # start, n, Hq, Hkv, D, bs
            _I64, _I64, _I64,  # stride_block, stride_offset, stride_head
            _F32, _PTR, _INT,  # scale, out, num_threads
        ],
        _INT,
    ),
    # x, delta, weight, y, rows, n, eps, num_threads
    "add_rms_norm": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT], None),
    "silu_mul": ([_PTR, _PTR, _I64, _I64, _INT], None),  # gate_up, out, rows, n, num_threads
    # x, row_stride, cos, sin, trig_stride, rows, heads, d, num_threads
    "rotate_in_place": ([_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT], None),
    "gemm_preferred": ([], _INT),
    "pack_panels": ([_PTR, _I64, _I64, _PTR], None),  # w, N, K, packed
    # a, lda, packed, c, M, N, K, num_threads, argmax (NULL: none)
    "gemm_panels": ([_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _INT, _PTR], _INT),
    # a, lda, packed, out, ldo, M, n, K, num_threads
    "gemm_gated": ([_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT], _INT),
    "argmax_bf16_kernels": ([], _INT),
    # a, lda, head16, norms, rows32, M, N, K, bound, max_norm, kernel, num_threads, argmax
    "argmax_bf16": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _F32, _F32, _INT, _INT, _PTR], _INT),
}  # fmt: skip


class NativeUnavailable(Exception):
    """Why the kernels cannot be used in this process (logged once by `native_library`)."""


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels (see the module docstring), or None; decided once a process."""
    if os.environ.get("CONTBATCH_NATIVE", "1") == "0":
        return None
    try:
        _check_openmp()
        return load_library(FLAGS)
    except (NativeUnavailable, OSError, RuntimeError) as exc:  # (RuntimeError: no home directory for the cache)
        log.warning("the engine's native kernels are off (%s): the torch paths run", exc)
        return None


def load_library(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library built with `flags` (cached; NativeUnavailable if it cannot be built), its
    functions typed. `FLAGS` + ("-DCONTBATCH_NATIVE_PORTABLE",) builds only the portable loops of
    the attention and the panel product, which a CPU without AVX2 and FMA runs."""
    library = ctypes.CDLL(str(_built(flags)))
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return library


def _check_openmp() -> None:
    """NativeUnavailable unless torch runs on OpenMP through a libgomp already loaded here (the
    kernel's `-fopenmp` then binds to that runtime, whose threads torch's operations use)."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        raise NativeUnavailable("torch's parallel backend is not OpenMP")
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        raise NativeUnavailable("cannot tell which OpenMP runtime is loaded (no /proc/self/maps)") from None
    if "libgomp" not in maps:
        raise NativeUnavailable("torch's OpenMP runtime is not libgomp")


def _built(flags: tuple[str, ...]) -> Path:
    """The shared library for this source, these flags and this CPU: the cached one, or built now."""
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(flags).encode(), _cpu().encode()):
        key.update(part)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contbatch" / "native"
    target = cache / f"kernels-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or "cc"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        try:
            done = subprocess.run(
                [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"],
                capture_output=True, text=True, check=False, timeout=300,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"the C compiler {compiler} did not run: {exc}") from None
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["(no message)"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise NativeUnavailable(f"{compiler} failed (exit {done.returncode}): {first_error.strip()}")
        os.replace(built, target)
    return target


def _cpu() -> str:
    """The CPU the library is built for (`-march=native`): its model and flags where Linux says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(sorted({line for line in lines if line.startswith(wanted)}))


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_ids: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Write into `out` [B, Hq, d] (contiguous) the attention of q [B, Hq, d] (heads and d
    contiguous in each row) over key and value caches [num_blocks, block_size, Hkv, d] (d
    contiguous), row b over the positions [lo[b], hi[b]) of its blocks `block_ids[b]`; False,
    leaving `out` alone, when the kernel is off or the tensors are not what it reads (`_readable`)."""
    library = native_library()
    if library is None or not _readable(q, key_cache, value_cache, out, block_ids, lo, hi):
        return False
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    failed = library.paged_decode(
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), block_ids.data_ptr(),
        block_ids.shape[1], lo.data_ptr(), hi.data_ptr(), rows, num_heads, num_kv_heads, head_dim, block_size,
        *key_cache.stride()[:3], scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native decode attention could not allocate its scores")
    return True


def paged_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_ids: torch.Tensor,
    start: int,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Write into `out` [n, Hq, d] (contiguous) the causal attention of a prefill chunk of one
    sequence: q [n, Hq, d] (heads and d contiguous in each row) at positions start, ..., start +
    n - 1, the query at position p over the keys at positions 0..p of the sequence's blocks
    `block_ids` (int64, covering start + n positions) in key and value caches [num_blocks,
    block_size, Hkv, d], already written; False, leaving `out` alone, as `paged_decode`."""
    library = native_library()
    if library is None or not _readable(q, key_cache, value_cache, out, block_ids):
        return False
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if block_ids.numel() * block_size < start + rows:
        raise ValueError(f"{block_ids.numel()} blocks of {block_size} cannot hold {start + rows} positions")
    failed = library.paged_prefill(
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), block_ids.data_ptr(), start, rows,
        num_heads, num_kv_heads, head_dim, block_size, *key_cache.stride()[:3], scale, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native prefill attention could not allocate its buffers")
    return True


def _on_cpu(dtype: torch.dtype, *tensors: torch.Tensor, contiguous: bool = True) -> bool:
    """Every tensor of `dtype` on the CPU (and contiguous, unless told otherwise)."""
    return all(t.dtype == dtype and t.device.type == "cpu" and (t.is_contiguous() or not contiguous) for t in tensors)


def _readable(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, *index: torch.Tensor
) -> bool:
    """The tensors are laid out as `paged_decode.c` reads them (float32 and int64 on the CPU)."""
    if not _on_cpu(torch.float32, q, keys, values, out, contiguous=False) or not _on_cpu(torch.int64, *index):
        return False
    head_dim = q.shape[2]
    return (
        q.stride(2) == 1
        and q.stride(1) == head_dim
        and keys.stride() == values.stride()
        and keys.stride(3) == 1
        and out.is_contiguous()
    )


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`h += delta` (when given), then h's rows RMS-normalised and scaled by `weight`
    (transformers' LlamaRMSNorm) as a new tensor, in one pass; None, h untouched, where the
    kernels are off or the tensors are not what `fused.c` reads (float32, contiguous, on the CPU;
    delta of h's shape, weight one row's width)."""
    library = native_library()
    if library is None:
        return None
    width = h.shape[-1]
    operands = (h, weight) if delta is None else (h, weight, delta)
    shapes_fit = weight.shape == (width,) and (delta is None or delta.shape == h.shape)
    if not shapes_fit or not _on_cpu(torch.float32, *operands):
        return None
    out = torch.empty_like(h)
    added = None if delta is None else delta.data_ptr()
    rows = h.numel() // width if width else 0
    threads = torch.get_num_threads()
    library.add_rms_norm(h.data_ptr(), added, weight.data_ptr(), out.data_ptr(), rows, width, eps, threads)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for `gate_up` [rows, 2 n] = [gate | up], as a new [rows, n] tensor; None
    where the kernels are off or gate_up is not float32, contiguous, 2-D, on the CPU."""
    library = native_library()
    if library is None or gate_up.dim() != 2 or gate_up.shape[1] % 2 or not _on_cpu(torch.float32, gate_up):
        return None
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, width))
    library.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
    return out


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [T, heads, head_dim] in place by cos, sin [T, head_dim] (the rotate-half convention,
    `contbatch.engine.rope.apply_rotary`'s bits) in one pass; False, x untouched, where the kernels
    are off or the tensors are not what `fused.c` reads (float32 on the CPU; x's heads contiguous
    and adjacent, its rows apart by at least a row; cos and sin rows of head_dim contiguous floats)."""
    library = native_library()
    if library is None or x.dim() != 3 or cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape:
        return False
    rows, heads, head_dim = x.shape
    laid_out = (
        x.stride(2) == 1
        and x.stride(1) == head_dim
        and (rows <= 1 or x.stride(0) >= heads * head_dim)  # (rows that overlap would be rotated twice)
        and cos.stride() == sin.stride()
        and cos.stride(1) == 1
    )
    if head_dim % 2 or not laid_out or not _on_cpu(torch.float32, x, cos, sin, contiguous=False):
        return False
    library.rotate_in_place(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), rows, heads, head_dim,
        torch.get_num_threads(),
    )  # fmt: skip
    return True


def panel_packing() -> bool:
    """Whether weights are best packed in panels here: the kernels run with their AVX2 and FMA
    loops, or their AVX-512 ones (`gemm.c`'s `gemm_preferred`; elsewhere oneDNN's packed
    products are the faster)."""
    library = native_library()
    return library is not None and library.gemm_preferred() == 1


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] on the CPU as `gemm.c`'s column panels: a 1-D tensor of N * K floats."""
    library = native_library()
    if library is None:
        raise NativeUnavailable("the native kernels are off: weights cannot be packed in panels")
    if weight.dim() != 2 or not _on_cpu(torch.float32, weight):
        raise ValueError(
            f"a panel-packed weight is a contiguous float32 [out, in] CPU matrix, got {tuple(weight.shape)}"
        )
    packed = huge_page_empty((weight.numel(),), weight.dtype)
    library.pack_panels(weight.data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
    return packed


def panel_product(x: torch.Tensor, packed: torch.Tensor, *, argmax: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times the weight `pack_panels` packed (transposed): a new contiguous [M, N] tensor.
    With `argmax` (a contiguous int64 [M] CPU tensor), also each row's first maximum, found while
    the products are in cache (`torch.argmax`'s rules: the lowest column on ties, a NaN counting
    as the maximum); MemoryError if its scratch could not be allocated."""
    library = native_library()
    if library is None:
        raise NativeUnavailable("the native kernels are off: a panel-packed weight cannot be multiplied")
    x = _panel_operand(x, packed, weight_rows=1)
    rows, width = x.shape
    if argmax is not None and (argmax.shape != (rows,) or not _on_cpu(torch.int64, argmax)):
        raise ValueError(f"argmax must be a contiguous int64 [{rows}] CPU tensor, got {tuple(argmax.shape)}")
    out = x.new_empty((rows, packed.numel() // width))
    if rows:
        threads = torch.get_num_threads()
        best = None if argmax is None else argmax.data_ptr()
        failed = library.gemm_panels(
            x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), rows, out.shape[1], width, threads, best
        )
        if failed:
            raise MemoryError("the native panel product could not allocate its argmax scratch")
    return out


def _panel_operand(x: torch.Tensor, packed: torch.Tensor, *, weight_rows: int) -> torch.Tensor:
    """x as the panel kernels read it (float32 on the CPU, unit stride along K), after checking
    that it fits `packed` (a whole multiple of `weight_rows` weight rows of x's width); ValueError
    otherwise."""
    width = x.shape[1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or width == 0 or packed.numel() % (weight_rows * width):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a panel-packed weight of {packed.numel()} floats")
    return x if x.stride(1) == 1 else x.contiguous()


def activation_rows(rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [rows, width] tensor (`like`'s dtype and device) for activations a panel product
    will read: its rows `width` elements apart, or 16 more where width is a multiple of 512. Rows
    2 KB apart, or a multiple of that, fall in one or two of L1's 64 sets, so a tile's 14 rows
    evict one another as the product reads them down k (the demo model's down projection, 1,024
    inputs: 1.06 x faster from rows 1,040 apart)."""
    pad = 16 if width % 512 == 0 else 0
    return like.new_empty((rows, width + pad))[:, :width]


def gated_panel_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x [M, K] times a panel-packed [gate | up] weight [2 n, K], as a new
    [M, n] tensor (rows apart as `activation_rows` lays them out): `silu_mul(panel_product(x,
    packed))`'s bits without the [M, 2 n] product in memory (`gemm.c`'s `gemm_gated`). None where
    the kernels are off or n is not a multiple of 32 (the caller multiplies and applies silu
    itself); ValueError as `panel_product`."""
    library = native_library()
    if library is None:
        return None
    x = _panel_operand(x, packed, weight_rows=2)
    rows, width = x.shape
    half = packed.numel() // (2 * width)
    if half % 32:
        return None
    out = activation_rows(rows, half, x)
    if rows and library.gemm_gated(
        x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), out.stride(0), rows, half, width,
        torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("the native gated product could not allocate its scratch")
    return out


@dataclass(frozen=True, slots=True)
class Bf16ArgmaxKernel:
    """One of `argmax_bf16`'s kernels (`gemm.c`): its code there, how many of the product's two
    operands it rounds to bfloat16 (1: the weight; 2: x too), and the multiple of K that each of
    its weight's rows is padded to with zeros (`pack_head_bf16`)."""

    code: int
    rounded_operands: int
    width_multiple: int
    layout: Callable[[torch.Tensor], torch.Tensor]  # [N, padded K] bfloat16 -> its elements in order

    def padded(self, width: int) -> int:
        return -(-width // self.width_multiple) * self.width_multiple


# fastest first: AMX's tile unit multiplies bfloat16 at many times the vector units' rate (the
# step then waits on memory alone), at the price of x rounded too (about twice the candidates)
BF16_ARGMAX_KERNELS = {
    "tiles": Bf16ArgmaxKernel(2, 2, 32, lambda w: w.view(w.shape[0] // 16, 16, w.shape[1] // 2, 2).transpose(1, 2)),
    "vectors": Bf16ArgmaxKernel(1, 1, 1, lambda w: w.view(w.shape[0] // 16, 16, w.shape[1]).transpose(1, 2)),
}


def argmax_bf16_kernels() -> list[str]:
    """The `BF16_ARGMAX_KERNELS` this build and CPU run, fastest first: "vectors" in the kernels'
    AVX-512 build, "tiles" where the CPU has AMX and Linux grants this process its tile state."""
    library = native_library()
    available = 0 if library is None else library.argmax_bf16_kernels()
    return [name for name, kernel in BF16_ARGMAX_KERNELS.items() if available & kernel.code]


def pack_head_bf16(weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """A float32 weight [N, K] (N a multiple of 32) rounded to bfloat16 (to nearest, ties to even)
    as `kernel` reads it, an int16 tensor of N * padded(K) elements: "vectors", `pack_panels`'
    layout; "tiles", for each 16 rows of the weight and each pair of k, the 16 rows' two elements
    (AMX's layout for tdpbf16ps), K padded with zeros to a multiple of 32."""
    n, k = weight.shape
    if n % 32 or not _on_cpu(torch.float32, weight):
        raise ValueError(f"a bfloat16 head is a contiguous float32 [32 m, K] CPU matrix, got {(n, k)}")
    chosen = BF16_ARGMAX_KERNELS[kernel]
    rows = F.pad(weight, (0, chosen.padded(k) - k)).bfloat16()
    return chosen.layout(rows).contiguous().view(torch.int16).reshape(-1)


def argmax_bf16(
    x: torch.Tensor,
    head16: torch.Tensor,
    norms: torch.Tensor,
    rows32: torch.Tensor,
    *,
    kernel: str,
    bound: float,
    max_norm: float,
    out: torch.Tensor,
) -> int:
    """Each row's argmax of x [M, K] times the head (`rows32` [N, K] float32; `head16` its
    `pack_head_bf16` for `kernel`; `norms` [N] its rows' norms, `max_norm` their largest) into `out`
    (int64 [M]): float32's, exactly, as `panel_product(argmax=...)` finds it; -1 for a row the
    kernel leaves to float32 (a norm not finite, too many candidates), and the count of those rows.
    `bound`: `ArgmaxHead`'s. ValueError for tensors it does not read, NativeUnavailable where
    `kernel` does not run, MemoryError without scratch."""
    if kernel not in argmax_bf16_kernels():
        raise NativeUnavailable(f"the bfloat16 argmax's {kernel!r} kernel does not run here")
    rows, width = x.shape
    n = rows32.shape[0]
    fits = (
        rows32.shape == (n, width)
        and norms.shape == (n,)
        and head16.shape == (n * BF16_ARGMAX_KERNELS[kernel].padded(width),)
        and head16.dtype == torch.int16
        and out.shape == (rows,)
        and _on_cpu(torch.float32, x, rows32, norms)
        and _on_cpu(torch.int64, out)
        and n % 32 == 0
    )
    if not fits:
        raise ValueError(f"x {tuple(x.shape)} does not fit a bfloat16 head of {tuple(rows32.shape)}")
    library = native_library()
    assert library is not None  # (argmax_bf16_kernels names none without it)
    left = library.argmax_bf16(
        x.data_ptr(), width, head16.data_ptr(), norms.data_ptr(), rows32.data_ptr(), rows, n, width, bound,
        max_norm, BF16_ARGMAX_KERNELS[kernel].code, torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if left == -2:
        raise NativeUnavailable(f"the bfloat16 argmax's {kernel!r} kernel does not run here")
    if left < 0:
        raise MemoryError("the bfloat16 argmax could not allocate its scratch")
    return int(left)
