"""Getting events from the driver thread to the asyncio side.

`Outbox` batches events per event loop and hands each batch over with one
`loop.call_soon_threadsafe`; a sink that raises is logged and the others still run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from contbatch.server.types import RequestEvent

log = logging.getLogger(__name__)

EventSink = Callable[[RequestEvent], None]  # called on its event loop's thread


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
