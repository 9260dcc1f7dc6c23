"""`LoadTracker`: a gateway's own accounting of the requests it routed, kept as `ReplicaView`s.

Both the cluster simulator and a real gateway call the same four methods as a request goes
through a replica: `routed` when it is sent, `first_token` when its first output arrives,
`finished` when it ends (any reason), and `scraped` for a `/metrics` scrape. The views they
produce are what routers decide on, so equal calls give equal decisions.

Invariants: a request is tracked on at most one replica at a time (`routed` twice raises); each
view's counts equal the sums over the requests tracked on it (`check`); `finished` and
`first_token` of an unknown request do nothing (a gateway may see late events).
"""

from __future__ import annotations

from dataclasses import dataclass

from contbatch.routing.view import ReplicaView, RouteRequest, Scrape


@dataclass(slots=True)
class _Routed:
    view: ReplicaView
    num_prompt_tokens: int
    decode_tokens: int  # its share of view.decode_tokens (0 before its first token)
    decoding: bool = False


class LoadTracker:
    def __init__(self) -> None:
        self._views: dict[str, ReplicaView] = {}
        self._routed: dict[str, _Routed] = {}

    # -- replicas --------------------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> ReplicaView:
        """Start tracking `replica_id` (ValueError if tracked already); its view."""
        if replica_id in self._views:
            raise ValueError(f"replica {replica_id!r} is tracked already")
        view = self._views[replica_id] = ReplicaView(replica_id)
        return view

    def remove_replica(self, replica_id: str) -> None:
        """Stop tracking a replica (ValueError while requests are in flight on it)."""
        view = self._views[replica_id]
        if view.num_in_flight:
            raise ValueError(f"replica {replica_id!r} still has {view.num_in_flight} requests in flight")
        del self._views[replica_id]

    def view(self, replica_id: str) -> ReplicaView:
        return self._views[replica_id]

    def views(self) -> list[ReplicaView]:
        """Every tracked replica's view, in the order they were added."""
        return list(self._views.values())

    # -- requests --------------------------------------------------------------------------------
    def routed(self, request: RouteRequest, replica_id: str) -> None:
        rid = request.request_id
        if rid in self._routed:
            raise ValueError(f"request {rid!r} is tracked already")
        view = self._views[replica_id]
        self._routed[rid] = _Routed(view, request.num_prompt_tokens, max(0, request.max_output_tokens - 1))
        view.num_in_flight += 1
        view.pending_prompt_tokens += request.num_prompt_tokens

    def first_token(self, request_id: str) -> None:
        entry = self._routed.get(request_id)
        if entry is None or entry.decoding:
            return
        entry.decoding = True
        view = entry.view
        view.pending_prompt_tokens -= entry.num_prompt_tokens
        view.num_decoding += 1
        view.decode_tokens += entry.decode_tokens

    def tokens(self, request_id: str, num_tokens: int) -> None:
        """`num_tokens` more output tokens streamed after the first: fewer may still come."""
        entry = self._routed.get(request_id)
        if entry is None or not entry.decoding:
            return
        taken = min(num_tokens, entry.decode_tokens)
        entry.decode_tokens -= taken
        entry.view.decode_tokens -= taken

    def finished(self, request_id: str) -> str | None:
        """The request ended; the replica it was on (None if unknown)."""
        entry = self._routed.pop(request_id, None)
        if entry is None:
            return None
        view = entry.view
        view.num_in_flight -= 1
        if entry.decoding:
            view.num_decoding -= 1
            view.decode_tokens -= entry.decode_tokens
        else:
            view.pending_prompt_tokens -= entry.num_prompt_tokens
        return view.replica_id

    def replica_of(self, request_id: str) -> str | None:
        entry = self._routed.get(request_id)
        return entry.view.replica_id if entry is not None else None

    def scraped(self, replica_id: str, scrape: Scrape | None) -> None:
        self._views[replica_id].scrape = scrape

    @property
    def num_in_flight(self) -> int:
        return len(self._routed)

    def check(self) -> None:
        """Each view's counts are the sums over its tracked requests (AssertionError if not)."""
        sums: dict[str, list[int]] = {rid: [0, 0, 0, 0] for rid in self._views}
        for entry in self._routed.values():
            row = sums[entry.view.replica_id]
            row[0] += 1
            row[1] += 0 if entry.decoding else entry.num_prompt_tokens
            row[2] += 1 if entry.decoding else 0
            row[3] += entry.decode_tokens if entry.decoding else 0
        for rid, view in self._views.items():
            got = [view.num_in_flight, view.pending_prompt_tokens, view.num_decoding, view.decode_tokens]
            if got != sums[rid]:
                raise AssertionError(f"replica {rid!r}: view counts {got} != tracked requests {sums[rid]}")
