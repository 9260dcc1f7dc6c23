"""Shared by the fleet tests: an inspect hook that checks every invariant after every event."""

from __future__ import annotations

from contbatch.core import check_invariants
from contbatch.sim.cluster import ClusterSim
from contbatch.sim.cluster_replica import Replica


def check_all(sim: ClusterSim, replica: Replica | None) -> None:
    """The fleet's accounting after every event; each replica's scheduler invariants between its
    steps (during a step its chunks' blocks are held before the results apply): right after its
    results (`replica`), and for every replica not in a step."""
    sim.check()
    if replica is not None:
        check_invariants(replica.scheduler)
        return
    for each in sim.replicas:
        if each.flight is None and each.run is None:  # (a decode run's scheduler is stale until it closes)
            check_invariants(each.scheduler)
