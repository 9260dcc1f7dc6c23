"""Keeping freed host memory for reuse: the CPU engine's large temporaries without page faults.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

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
