"""The simulators' loops (`simulate`, `simulate_cluster`) and a run's summary make no reference
cycles: reference counting frees all their garbage. Yet they hold millions of objects (the trace,
every request's timeline, a row per finished request), which every automatic collection of
CPython's cyclic garbage collector walks again, for nothing: 4-7 % of a long simulation's CPU
time, a fifth of a summary's. So the collector is paused while they run.

Invariants (tests/sim/test_no_cycles.py): a simulation leaves no unreachable object behind, under
random traces and configurations, every cost model, prefix caching and swapping; the collector's
state is restored on exit, exception or not. A cycle something else makes meanwhile (an observer,
say) waits for the next automatic collection after the run.
"""

from __future__ import annotations

from contbatch.collector import cyclic_gc_paused

__all__ = ["cyclic_gc_paused"]
