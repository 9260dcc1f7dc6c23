"""The KV transfer link of a disaggregated fleet: prompt KV moved from a prefill replica to a
decode replica, priced from the model's KV bytes per token.

Each replica has one port each way of `bandwidth` bytes per time unit. A transfer of `n` tokens
moves ``n * kv_bytes_per_token`` bytes; it starts when both its source's outgoing port and its
destination's incoming port are free (transfers on one port go one after another, in the order
they were asked for: that is the contention), holds both for bytes / bandwidth, and arrives
`latency` after that.

Invariants: a transfer never starts before it is asked for; on each port, transfers never
overlap; every transfer asked for arrives (`num_transfers` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

from contbatch.sim.cluster_config import FleetError, LinkConfig, PoolSpec


def kv_bytes_per_token(link: LinkConfig, prefill: PoolSpec) -> float:
    """The link's bytes per prompt token: given, or the prefill pool's model spec's (roofline)."""
    if link.kv_bytes_per_token is not None:
        return link.kv_bytes_per_token
    model = getattr(prefill.cost, "model", None)
    per_token = getattr(model, "kv_bytes_per_token", None)
    if per_token is None:
        raise FleetError(
            f"link: the cost model of pool {prefill.name} ({prefill.cost_spec or type(prefill.cost).__name__}) has "
            "no model spec; give kv_bytes_per_token (e.g. 524288 for llama-2-7b in fp16)"
        )
    return float(per_token(1))


@dataclass(slots=True)
class TransferStats:
    num_transfers: int = 0
    num_bytes: float = 0.0
    busy_time: float = 0.0  # sum of transfer durations (latency included)
    wait_time: float = 0.0  # sum of time spent queued behind other transfers on a port
    max_wait: float = 0.0

    def as_dict(self) -> dict[str, object]:
        n = self.num_transfers
        return {
            "num_transfers": n,
            "transfer_bytes": self.num_bytes,
            "transfer_mean_time": self.busy_time / n if n else None,
            "transfer_mean_wait": self.wait_time / n if n else None,
            "transfer_max_wait": self.max_wait,
        }


class KVLink:
    def __init__(self, link: LinkConfig, bytes_per_token: float) -> None:
        self.link = link
        self.bytes_per_token = bytes_per_token
        self._out_free: dict[str, float] = {}
        self._in_free: dict[str, float] = {}
        self.stats = TransferStats()

    def transfer(self, source: str, destination: str, num_tokens: int, now: float) -> float:
        """Schedule a transfer of `num_tokens` tokens' KV asked for at `now`; when it arrives."""
        start = max(now, self._out_free.get(source, now), self._in_free.get(destination, now))
        size = num_tokens * self.bytes_per_token
        busy_until = start + size / self.link.bandwidth
        self._out_free[source] = self._in_free[destination] = busy_until
        arrival = busy_until + self.link.latency
        stats = self.stats
        stats.num_transfers += 1
        stats.num_bytes += size
        stats.busy_time += arrival - start
        stats.wait_time += start - now
        stats.max_wait = max(stats.max_wait, start - now)
        return arrival
