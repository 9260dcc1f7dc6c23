"""What a router sees: the request being routed and one `ReplicaView` per routable replica.

A view holds only what a real gateway in front of OpenAI-compatible servers can know:

- its own accounting of the requests it routed (`LoadTracker` keeps it): requests in flight,
  prompt tokens still waiting for a first token, requests decoding and the output tokens they
  may still produce (their `max_tokens` less what was streamed, as the gateway counts it);
- the replica's last scrape of `/metrics` (`Scrape`: waiting and running requests, KV usage),
  possibly old (`Scrape.ts`; the simulator's `signal_delay` feeds scrapes as of `now - delay`).

Views are mutable records owned by whoever feeds them (the tracker, the simulator, a gateway);
routers only read them. Invariants: every count is >= 0; `kv_usage` is in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request being routed, as a gateway sees it before sending it anywhere."""

    request_id: str
    num_prompt_tokens: int
    max_output_tokens: int
    # chained hashes of the prompt's full KV blocks (block i's key covers every token before its
    # end: equal prefixes give equal leading keys); () when unknown or unused
    prefix_keys: tuple[int, ...] = ()
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Scrape:
    """One scrape of a replica's `/metrics` (vLLM's `num_requests_waiting`, `num_requests_running`
    and KV cache usage), taken at `ts` on the caller's clock."""

    ts: float
    num_waiting: int
    num_running: int
    kv_usage: float  # fraction of KV blocks in use, in [0, 1]


@dataclass(slots=True)
class ReplicaView:
    """One routable replica (see the module docstring). Routers read it; its owner updates it."""

    replica_id: str
    num_in_flight: int = 0  # routed here by this gateway and not finished
    pending_prompt_tokens: int = 0  # prompt tokens of in-flight requests with no first token yet
    num_decoding: int = 0  # in-flight requests past their first token
    decode_tokens: int = 0  # output tokens those may still produce (max_tokens - streamed)
    scrape: Scrape | None = None  # the latest /metrics scrape the caller lets the router see

    @property
    def num_waiting(self) -> int:
        """Queue length: the scrape's waiting requests, else the gateway's own (no first token yet)."""
        return self.scrape.num_waiting if self.scrape is not None else self.num_in_flight - self.num_decoding

    @property
    def kv_usage(self) -> float | None:
        return self.scrape.kv_usage if self.scrape is not None else None
