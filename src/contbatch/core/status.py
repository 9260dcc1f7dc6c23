"""Request states and finish reasons.

State machine (every other transition is a bug and raises `IllegalTransition`)::

    WAITING ──admit──► RUNNING ──preempt──► PREEMPTED ──admit──► RUNNING
       │                  │                     │
       └──────────────────┴──── finish ─────────┴──► FINISHED

A request is FINISHED exactly once, with exactly one `FinishReason`.
"""

from __future__ import annotations

import enum

from mypy_extensions import mypyc_attr


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # arrived, never scheduled
    RUNNING = "running"  # holds a running slot (and, with a KV manager, its blocks)
    PREEMPTED = "preempted"  # back in the waiting queue after holding a slot
    FINISHED = "finished"  # terminal

    @property
    def is_waiting(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class FinishReason(enum.Enum):
    LENGTH = "length"  # produced its maximum number of output tokens
    STOP = "stop"  # the executor saw a stop token or string
    CANCELLED = "cancelled"  # the client or an operator cancelled it
    TIMEOUT = "timeout"  # a time-to-first-token or total-time limit passed
    REJECTED = "rejected"  # refused at admission (can never fit, queue full, ...)
    ERROR = "error"  # the executor failed while computing it


@mypyc_attr(native_class=False)  # (compiled, a class cannot derive from RuntimeError)
class IllegalTransition(RuntimeError):
    """A request was asked to move between states the state machine does not connect."""


# the edges out of each state, keyed by its value (a str: hashing an enum member runs Python
# code, and every admission and finish checks an edge); tuples compare members by identity
_ALLOWED: dict[str, tuple[RequestStatus, ...]] = {
    RequestStatus.WAITING.value: (RequestStatus.RUNNING, RequestStatus.FINISHED),
    RequestStatus.RUNNING.value: (RequestStatus.PREEMPTED, RequestStatus.FINISHED),
    RequestStatus.PREEMPTED.value: (RequestStatus.RUNNING, RequestStatus.FINISHED),
    RequestStatus.FINISHED.value: (),
}


def check_transition(request_id: str, old: RequestStatus, new: RequestStatus) -> None:
    """Raise `IllegalTransition` unless `old -> new` is an edge of the state machine."""
    if new not in _ALLOWED[old._value_]:
        raise IllegalTransition(f"request {request_id!r}: {old.value} -> {new.value} is not allowed")
