"""The engine's native CPU kernel: decode attention read in place from the paged KV cache.

The torch path of `contbatch.engine.attention` copies every decode row's keys and values out of
their blocks (one gather per layer), pads the rows to the longest and masks the rest, then runs
scaled-dot-product attention; `paged_decode.c` reads each key and value once where it lies, each
row over its own keys only. It is C compiled on first use by the machine's compiler (`$CC`, else
`cc`) with `FLAGS` (`-O3 -march=native -fopenmp`, ...), and called through ctypes. On a CPU with
AVX2 and FMA its inner loops are vector code written for them (eight keys' scores at a time);
elsewhere, and in the build `load_kernel` makes with `-DPAGED_DECODE_PORTABLE`, plain loops
that the compiler vectorises.

`decode_kernel()` gives the kernel, or None, and the engine keeps its torch path, when:
CONTBATCH_NATIVE=0 is set; the process's OpenMP runtime is not the libgomp that torch runs on (the
kernel's threads must be torch's own: a second runtime's would spin beside them, as two OpenMP
teams did in the server before, `contbatch.engine.serving`); there is no compiler, or the build
fails (logged once). The library is cached under $XDG_CACHE_HOME/contbatch/native (default
~/.cache), named by a hash of the source, the flags and the CPU's model and flags (it is built for
this CPU), and loaded from there without a compiler; it is written under a temporary name and
renamed, so that processes starting at once never load a half-written file.

Invariant: the kernel's output equals the torch path's to float32 rounding (different summation
orders, an exponential within about 1 ulp; `tests/engine/test_engine_native.py` holds both
builds within 1e-5 on every shape the engine runs: grouped-query, multi-query and multi-head,
windows, rows of different contexts).
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
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
# -fno-trapping-math: no floating-point operation here traps, and the compiler may then vectorise
# the softmax's exponential (its clamp is a comparison)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fPIC", "-shared")

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# paged_decode's parameters, in order (paged_decode.c)
_ARGTYPES: list[Any] = [
    _PTR, _I64,  # q, q_stride_row
    _PTR, _PTR, _PTR, _I64,  # key_cache, value_cache, tables, W
    _PTR, _PTR,  # lo, hi
    _I64, _I64, _I64, _I64, _I64,  # B, Hq, Hkv, D, bs
    _I64, _I64, _I64,  # stride_block, stride_offset, stride_head
    ctypes.c_float, _PTR, ctypes.c_int,  # scale, out, num_threads
]  # fmt: skip

DecodeKernel = Callable[..., int]


class NativeUnavailable(Exception):
    """Why the kernel cannot be used in this process (logged once by `decode_kernel`)."""


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """The compiled `paged_decode` (see the module docstring), or None; decided once a process."""
    if os.environ.get("CONTBATCH_NATIVE", "1") == "0":
        return None
    try:
        _check_openmp()
        return load_kernel(FLAGS)
    except (NativeUnavailable, OSError, RuntimeError) as exc:  # (RuntimeError: no home directory for the cache)
        log.warning("the engine's native decode attention is off (%s): attention gathers the cache", exc)
        return None


def load_kernel(flags: tuple[str, ...]) -> DecodeKernel:
    """`paged_decode` of the library built with `flags` (cached; NativeUnavailable if it cannot be
    built). `FLAGS` + ("-DPAGED_DECODE_PORTABLE",) builds only its portable loops, which a CPU
    without AVX2 and FMA runs."""
    kernel = ctypes.CDLL(str(_built(flags))).paged_decode
    kernel.argtypes = _ARGTYPES
    kernel.restype = ctypes.c_int
    return kernel


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
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), _cpu().encode()):
        key.update(part)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contbatch" / "native"
    target = cache / f"paged_decode-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or "cc"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        try:
            done = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                capture_output=True, text=True, check=False, timeout=300,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"the C compiler {compiler} did not run: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise NativeUnavailable(f"{compiler} failed (exit {done.returncode}): {last}")
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
    kernel = decode_kernel()
    if kernel is None or not _readable(q, key_cache, value_cache, out, block_ids, lo, hi):
        return False
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    failed = kernel(
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), block_ids.data_ptr(),
        block_ids.shape[1], lo.data_ptr(), hi.data_ptr(), rows, num_heads, num_kv_heads, head_dim, block_size,
        *key_cache.stride()[:3], scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native decode attention could not allocate its scores")
    return True


def _readable(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, *index: torch.Tensor
) -> bool:
    """The tensors are laid out as `paged_decode.c` reads them (float32 and int64 on the CPU)."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (q, keys, values, out)):
        return False
    if any(t.device.type != "cpu" or t.dtype != torch.int64 or not t.is_contiguous() for t in index):
        return False
    head_dim = q.shape[2]
    return (
        q.stride(2) == 1
        and q.stride(1) == head_dim
        and keys.stride() == values.stride()
        and keys.stride(3) == 1
        and out.is_contiguous()
    )
