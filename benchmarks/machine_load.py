"""How busy the machine is, from /proc/stat: what the benchmarks read to tell a quiet machine from
a shared one (`engine_step.py` waits for quiet, `validate_sim.py` too and counts its neighbours'
CPUs, `engine_vs_peer.py` counts everything else's beside each server)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU since boot: /proc/stat's first line, user through
    steal (guest time is counted inside user already); idle and iowait are the not-busy ones.
    OSError or ValueError off Linux."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    if len(fields) < 5:
        raise ValueError("/proc/stat: no CPU line")
    total = sum(fields)
    return total - fields[3] - fields[4], total


def busy_fraction(seconds: float = 1.0) -> float:
    """The fraction of the machine's CPU time spent busy over the next `seconds` (this process
    sleeps meanwhile); off Linux, the load average per CPU."""
    try:
        busy0, total0 = cpu_ticks()
        time.sleep(seconds)
        busy1, total1 = cpu_ticks()
    except (OSError, ValueError):
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    return (busy1 - busy0) / max(1, total1 - total0)
