"""Getting events from the driver thread to the asyncio side.

`Outbox` batches events per event loop and hands each batch over with one
`loop.call_soon_threadsafe`; a sink that raises is logged, the others still run, and `on_error`
(the driver's: it ends that request with an error) is told which request's event was lost.
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
SinkError = Callable[[str, Exception], None]  # (request id, what its sink raised), on the sink's thread


@dataclass(slots=True)
class Outbox:
    items: dict[asyncio.AbstractEventLoop, list[tuple[EventSink, RequestEvent]]] = field(default_factory=dict)
    on_error: SinkError | None = None

    def put(self, loop: asyncio.AbstractEventLoop, sink: EventSink, event: RequestEvent) -> None:
        self.items.setdefault(loop, []).append((sink, event))

    def flush(self) -> None:
        items, self.items = self.items, {}
        for loop, batch in items.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its clients are gone
                loop.call_soon_threadsafe(_dispatch, batch, self.on_error)


def _dispatch(batch: list[tuple[EventSink, RequestEvent]], on_error: SinkError | None = None) -> None:
    for sink, event in batch:
        try:
            sink(event)
        except Exception as exc:  # a broken sink must not stop the others
            log.exception("event sink of %s failed", event.request_id)
            if on_error is not None:
                try:
                    on_error(event.request_id, exc)
                except Exception:
                    log.exception("the sink error of %s could not be reported", event.request_id)
