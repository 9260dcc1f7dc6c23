"""Getting events from the driver thread to the asyncio side, and the text rules applied on the way.

`LiveRequest` is the driver's record of a request it has not finished (its sink and the text it
holds back). `Outbox` batches events per event loop and hands each batch over with one
`loop.call_soon_threadsafe`; a sink that raises is logged and the others still run. `cut_at_stop`
applies stop strings to text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from contbatch.core.request import Request
from contbatch.server.types import RequestEvent

log = logging.getLogger(__name__)

EventSink = Callable[[RequestEvent], None]  # called on its event loop's thread


@dataclass(slots=True, eq=False)
class LiveRequest:
    request: Request
    loop: asyncio.AbstractEventLoop
    sink: EventSink
    stop: tuple[str, ...]
    num_delivered: int = 0  # output tokens already sent to the sink
    pending: str = ""  # text held back: it may be the start of a stop string


@dataclass(slots=True)
class Outbox:
    items: dict[asyncio.AbstractEventLoop, list[tuple[EventSink, RequestEvent]]] = field(default_factory=dict)

    def put(self, loop: asyncio.AbstractEventLoop, sink: EventSink, event: RequestEvent) -> None:
        self.items.setdefault(loop, []).append((sink, event))

    def flush(self) -> None:
        items, self.items = self.items, {}
        for loop, batch in items.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its clients are gone
                loop.call_soon_threadsafe(_dispatch, batch)


def _dispatch(batch: list[tuple[EventSink, RequestEvent]]) -> None:
    for sink, event in batch:
        try:
            sink(event)
        except Exception:  # a broken sink must not stop the others
            log.exception("event sink of %s failed", event.request_id)


def cut_at_stop(live: LiveRequest, text: str, *, final: bool) -> tuple[str, bool]:
    """(text to send now, whether a stop string was found). Holds back a tail that may begin a
    stop string until the next event or the end."""
    if not live.stop:
        return text, False
    buffer = live.pending + text
    hits = [i for s in live.stop if (i := buffer.find(s)) >= 0]
    if hits:
        live.pending = ""
        return buffer[: min(hits)], True
    if final:
        live.pending = ""
        return buffer, False
    keep = max(len(s) for s in live.stop) - 1
    cut = max(0, len(buffer) - keep)
    live.pending = buffer[cut:]
    return buffer[:cut], False
