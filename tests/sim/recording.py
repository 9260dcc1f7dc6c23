"""Schedulers that record what the loop hands them, for tests that check each request at the end.

A subclass, not a method patched on an instance: compiled (`contbatch.compiled`), a scheduler's
methods cannot be reassigned on an instance, and its own calls (a timeout cancels from inside
`schedule`) reach an override, never an instance attribute. `recording(cls)(config)` is a `cls`
that keeps every request handed over in `handed_over`, in order, and runs `around_cancel`, when
set, around each `cancel` call: `around_cancel(request_id, now, call)`, where `call()` cancels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from contbatch.core import FinishReason, Request, SchedulerBase, SchedulerConfig
from contbatch.core.outputs import AddDecision

AroundCancel = Callable[[str, float, Callable[[], bool]], bool]


@functools.cache
def recording(base: type[SchedulerBase]) -> Any:
    """`base` with the records above (one class per base)."""

    class Recording(base):  # type: ignore[valid-type,misc]
        def __init__(self, config: SchedulerConfig) -> None:
            super().__init__(config)
            self.handed_over: list[Request] = []
            self.around_cancel: AroundCancel | None = None

        def add_request(self, request: Request, now: float) -> AddDecision:
            self.handed_over.append(request)
            return super().add_request(request, now)  # type: ignore[no-any-return]

        def cancel(
            self, request_id: str, now: float, reason: FinishReason = FinishReason.CANCELLED, *, detail: str = ""
        ) -> bool:
            def call() -> bool:
                return bool(super(Recording, self).cancel(request_id, now, reason, detail=detail))

            return call() if self.around_cancel is None else self.around_cancel(request_id, now, call)

    Recording.__name__ = Recording.__qualname__ = f"Recording{base.__name__}"
    return Recording
