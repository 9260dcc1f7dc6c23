"""Host memory for the CPU engine: large temporaries kept for reuse without page faults, and
large long-lived tensors on huge pages.

A forward step on the CPU allocates and frees tensors of several MiB per layer (the fused
projections' outputs, the MLP's [tokens, intermediate] activations). glibc's malloc gives such
blocks back to the kernel when they are freed (an `mmap`ed block is unmapped; the top of a heap is
trimmed; a thread arena's emptied 64 MiB heap is deleted), so the next step's allocation of the
same size faults in fresh zeroed pages: tens of thousands of page faults per prefill step of a
2,048-token budget on the demo model, a large part of its time (the server steps the engine in
its own thread, whose arena deletes heaps the most).

`retain_freed_memory()` tunes malloc, once per process, to keep such memory: blocks up to 32 MiB
come from the heaps (`M_MMAP_THRESHOLD`, glibc's upper bound), a heap's free top is kept up to
1 GiB (`M_TRIM_THRESHOLD`), and heaps grow with 64 MiB of padding (`M_TOP_PAD`), which also keeps
an emptied thread heap from being deleted. The process then holds on to its peak temporary
memory, as a caching allocator would. Only where the C library has glibc's `mallopt`; anything
else is left alone. Returns whether the settings were applied (now or by an earlier call).

`huge_page_empty(shape, dtype)` is `torch.empty` on the CPU whose memory Linux may back with 2 MiB
transparent huge pages (`madvise(MADV_HUGEPAGE)` before any page is touched; what the kernel does
where THP is "madvise" or "always"): for the paged KV cache, whose blocks a decode step reads
scattered over hundreds of MiB, one TLB entry then covers 2 MiB instead of 4 KiB (decode attention
over blocks at random places in the cache about 15 % faster, nothing slower), and for weights
packed in panels that are that large (the demo model's LM head, 49 MB, read whole every step).
The tensor starts on a 2 MiB boundary; where madvise is missing or refuses, it is plain memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from collections.abc import Callable

import torch

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 * 1024**2), (_M_TRIM_THRESHOLD, 1024**3), (_M_TOP_PAD, 64 * 1024**2))


@functools.cache
def retain_freed_memory() -> bool:
    """Apply the settings of the module docstring (once); False where glibc's `mallopt` is missing
    or refuses one of them."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)


HUGE_PAGE = 2 * 1024**2
_MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>
# smaller tensors come from malloc's heaps (`retain_freed_memory`), perhaps touched already; and
# their 2 MiB of alignment would be a large share
_HUGE_PAGE_MIN_BYTES = 32 * 1024**2


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where Linux gives them (see the module
    docstring); tensors under 32 MiB are plain `torch.empty`."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    madvise = _madvise()
    if nbytes < _HUGE_PAGE_MIN_BYTES or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # (not touched: malloc maps it fresh)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + start, nbytes, _MADV_HUGEPAGE)  # (a refusal leaves plain pages)
    return raw[start : start + nbytes].view(dtype).view(shape)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise on Linux, else None."""
    if platform.system() != "Linux":
        return None
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise
