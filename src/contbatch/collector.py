"""CPython's cyclic garbage collector around work that makes no reference cycles: paused while it
runs (`cyclic_gc_paused`: the simulators' loops, `contbatch.sim.no_cycles`), paused with what it
allocated promoted on the way out (`collector_paused`: the simulation commands), and the start-up
heap frozen before a server or a load generator runs (`freeze_startup_heap`). Imports nothing
of contbatch's: the simulator and the command line both use it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (restored after, as it was); usable as a
    decorator too."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, and what the block allocated promoted
    to the oldest generation on the way out instead of walked by the next young collection.

    A simulation command reads the trace, simulates and summarises: none of it makes reference
    cycles (`contbatch.sim.no_cycles`), yet with the collector on, reading the trace triggers a
    young collection every 700 objects and the first allocation after a simulation walks every
    object the run left (each request's timeline and token lists; some 25 ms for 10,000
    requests). `gc.freeze()` then `gc.unfreeze()` moves every tracked object to the oldest
    generation without walking it (skipped when something else froze objects: its
    frozen set is left as it is); a cycle made in the block is found by the next full
    collection. The collector's state is restored on exit, exception or not."""
    enabled = gc.isenabled()
    with cyclic_gc_paused():
        try:
            yield
        finally:
            if enabled and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()


def freeze_startup_heap() -> None:
    """Collect, then move every object alive to the collector's permanent generation: the
    start-up heap (the model's and tokenizer's objects, the imported modules, the app, a
    workload's requests) is then never walked by an oldest-generation collection, which
    otherwise stops every stream, or a load generator's clock, for the time it takes to walk it
    (some 209,000 objects and 39-43 ms in `serve --backend engine` with the demo model; vLLM,
    SGLang and TensorRT-LLM freeze theirs likewise). What runs afterwards is collected as before;
    a frozen object is never freed by the collector, which is why the collection comes first."""
    gc.collect()
    gc.freeze()
