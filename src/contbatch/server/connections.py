"""Connection-level limits that uvicorn lacks, added to its HTTP protocols (`LimitedProtocol`, which
`contbatch serve` and `contbatch route` run on, over the request parser `--http` names: httptools,
uvicorn's C parser, when it is installed, else h11, in pure Python):

- a time limit on a request's head. uvicorn closes a keep-alive connection idle after a response
  (``timeout_keep_alive``) but waits forever for the head of a request: a client that connects
  and sends nothing, or sends its headers a byte at a time (slow loris), holds its connection,
  and enough of them use up ``--limit-concurrency`` (then everyone gets 503) or the process's file
  descriptors. A connection whose request head has not arrived in full `head_timeout_s` after it
  connected, or after its previous response, is closed. (The body's own limit is the server's:
  `ServerConfig.body_timeout_s`, a 408.)
- a bounded kernel send buffer per connection (`send_buffer`, bytes), and asyncio's write buffer
  in front of it at a quarter of that (64 KiB by default). Linux grows a connection's send buffer
  up to 4 MB while the peer does not read, some 17,000 streamed tokens the server believes
  delivered; bounded, a client that stops reading stops acknowledging output soon, and its request
  pauses at its output credits (`lifecycle.output_credits`, `max_pause`).
- ``TCP_NODELAY`` on every connection: asyncio sets it only on sockets of its own making, so a
  listening socket handed to uvicorn would answer small responses 40 ms late (delayed ACKs).

And, given an `Activity`, when bytes last came in on any connection (a connection opened counts):
an idle engine's gathered first step waits for a burst still being read
(`contbatch.server.driver.Gather.last_activity`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    _Protocol = H11Protocol  # what the limits need of a uvicorn protocol, which the httptools one has too
else:
    _Protocol = object


def _httptools() -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


PARSERS: dict[str, Callable[[], type[Any]]] = {"h11": lambda: H11Protocol, "httptools": _httptools}
AUTO = "auto"  # httptools when it is installed, else h11 (as uvicorn's own `--http auto`)


def parser_name(choice: str) -> str:
    """The parser `choice` (a key of `PARSERS`, or `AUTO`) stands for here."""
    if choice != AUTO:
        return choice
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


class Activity:
    """When bytes last came in on one of a server's connections (`time.monotonic()`; -inf before
    any): its protocols `touch` it from the event loop, the step driver's thread reads it (a float
    attribute: each read sees one whole value)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = float("-inf")

    def touch(self) -> None:
        self.last = time.monotonic()

    def __call__(self) -> float:
        return self.last


class LimitedProtocol(_Protocol):
    """A head timeout and a bounded send buffer (module docstring), mixed into a uvicorn HTTP
    protocol (`limited_protocol`). Both protocols it goes with parse what arrives in
    `data_received` and keep the request under way as `cycle` (None before the first)."""

    head_timeout_s: ClassVar[float | None] = 20.0
    send_buffer: ClassVar[int | None] = 64 << 10
    activity: ClassVar[Activity | None] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.activity is not None:
            self.activity.touch()
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # (see the module docstring)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.send_buffer:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
                # and asyncio's own buffer in front of it (64 KiB by default) in proportion
                transport.set_write_buffer_limits(high=self.send_buffer // 4)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.activity is not None:
            self.activity.touch()
        super().data_received(data)
        if not self._waiting_for_head() and self._head_timer is not None:
            self._head_timer.cancel()  # a request is under way: its body has its own limit
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self.head_timeout_s:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


def limited_protocol(
    head_timeout_s: float | None, send_buffer: int | None, parser: str = AUTO, activity: Activity | None = None
) -> type[Any]:
    """`LimitedProtocol` with its limits (None or 0: none) over `parser`'s protocol (`PARSERS`,
    or `AUTO`), touching `activity` when given, for ``uvicorn.Config(http=...)``. ImportError when
    that parser is not installed."""
    limits = {"head_timeout_s": head_timeout_s or None, "send_buffer": send_buffer or None, "activity": activity}
    return type("LimitedProtocol", (LimitedProtocol, PARSERS[parser_name(parser)]()), limits)
