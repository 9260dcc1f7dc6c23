"""The step driver: the one step loop (`contbatch.loop.EngineCore`) on a background thread, on a
wall clock, between the asyncio side and a backend's executor.

One thread owns the loop (its scheduler and executor); nothing else touches them. Each
iteration::

    apply the inbox (submissions, cancellations, acks)     # only at step boundaries
    core.step()                                            # schedule, execute, update, outputs
    route each output to its request's asyncio sink

The asyncio side calls `submit`, `abort`, `fail` and `ack` from any thread: they append to a locked
inbox and wake the thread. Outputs go back with `loop.call_soon_threadsafe`, batched per event
loop, once after the inbox is applied and once after each step. With nothing to run the thread
sleeps until a submission or the loop's next timer (timeouts, paused streams).

Bursts (`Gather`, off by default): when the engine was idle and work comes in, the first step
can wait for the rest of a burst, taking submissions until none arrived for `Gather.gap_s` (at
most `Gather.max_s` in all). Without it the first step runs the first arrival alone, and the rest
of the burst, arriving meanwhile, waits behind that step; with a queue order that picks among the
waiting (`shortest`, `priority`), the step also picks from the whole burst. A lone request pays
at most `gap_s`; a busy engine never waits (arrivals join at the next step boundary).

What a request goes through (intake, detokenization, stop strings, finishing, failure of its
step or of its own output processing) is the loop's; the driver adds the server's protocol:
each request's events go to its own sink, and a submission the loop cannot take (a duplicate
id, an invalid request, a scheduler that raises on it) is rejected here. A request whose event
could not be delivered (its sink raised, or the HTTP side could not write it: `fail`) ends with
ERROR ("its output could not be delivered"); its final event still goes to its sink. An
unexpected error in the driver itself fails the requests that were live and the loop goes on.

Shutdown (`stop`): new submissions are refused (`DriverClosed`); in-flight requests get a grace
period to finish, then the rest are cancelled (CANCELLED, "the server shut down") and the thread
exits.

Invariants: every submission gets exactly one final event; events of a request are delivered in
order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from contbatch.core import make_scheduler
from contbatch.core.status import FinishReason
from contbatch.loop import EngineCore, Intake, IntakeError, StepObserver, TextStream, WallClock
from contbatch.server.backends.base import Backend
from contbatch.server.delivery import EventSink, Outbox
from contbatch.server.types import DriverSnapshot, RequestEvent, Submission

log = logging.getLogger(__name__)

DELIVERY_FAILED = "its output could not be delivered"  # how a delivery failure's detail begins


class DriverClosed(RuntimeError):
    """The driver no longer accepts submissions (shutting down, or stopped)."""


@dataclass(frozen=True, slots=True)
class Gather:
    """How the first step after an idle spell waits for a burst: until no submission arrived for
    `gap_s` seconds, at most `max_s` after it began waiting. `gap_s` 0: no waiting. With
    `last_activity` (when bytes last came in on the HTTP side, `time.monotonic()`: the server's
    `connections.Activity`), also until none came in for `gap_s`: requests whose connections are
    still being opened or read belong to the burst."""

    gap_s: float = 0.0
    max_s: float = 0.25
    last_activity: Callable[[], float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("gap_s", "max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ValueError(f"gather {name} must be a number >= 0, got {value!r}")


NO_GATHER = Gather()  # the default: an idle engine's first step starts at once


class Driver:
    def __init__(
        self,
        backend: Backend,
        *,
        scheduler: str = "continuous",
        clock: Callable[[], float] = time.monotonic,
        observers: Sequence[StepObserver] = (),
        gather: Gather = NO_GATHER,
    ) -> None:
        self.backend = backend
        self.gather = gather
        self.scheduler = make_scheduler(scheduler, backend.config)
        config = self.scheduler.config
        kv = config.kv
        self.intake = Intake(  # thread-safe: the HTTP side tokenizes with it, the driver builds requests
            encode=backend.tokenize,
            vocab_size=backend.vocab_size,
            max_model_len=config.max_model_len,
            hash_block_size=kv.block_size if kv is not None and kv.enable_prefix_caching else None,
        )
        self.core = EngineCore(self.scheduler, backend.executor, WallClock(clock), observers=observers)
        self._clock = clock
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._outbox = Outbox(on_error=self._sink_failed)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, EventSink]] = {}
        self._num_live = 0  # submitted, final event not yet routed (under _cond)
        self._accepting = True
        self._halt = False
        self._thread: threading.Thread | None = None
        self.snapshot = DriverSnapshot()  # replaced (never mutated) after every iteration
        self._rejections: dict[str, int] = {}  # kind -> submissions refused here (the scheduler never saw them)

    # -- any thread ----------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the driver is already started")
        self._thread = threading.Thread(target=self._run, name="contbatch-driver", daemon=True)
        self._thread.start()

    def submit(self, submission: Submission, loop: asyncio.AbstractEventLoop, sink: EventSink) -> None:
        """Queue a request; its events go to `sink` on `loop`. `DriverClosed` once stopping."""
        with self._cond:
            if not self._accepting or self._halt:
                raise DriverClosed("the server is shutting down")
            self._inbox.append(("submit", submission, loop, sink))
            self._num_live += 1
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Cancel at the next step boundary (its KV is freed then); unknown or finished: no-op."""
        self._post(("abort", request_id))

    def fail(self, request_id: str, detail: str) -> None:
        """End the request with ERROR and `detail` at the next step boundary (its output could not
        be delivered); unknown or finished: no-op."""
        self._post(("fail", request_id, detail))

    def _sink_failed(self, request_id: str, exc: Exception) -> None:
        self.fail(request_id, f"{DELIVERY_FAILED}: {type(exc).__name__}: {exc}")

    def ack(self, request_id: str, num_tokens: int) -> None:
        """The client took `num_tokens` more output tokens (frees output credits)."""
        if num_tokens > 0:
            self._post(("ack", request_id, num_tokens))

    def _post(self, op: tuple[Any, ...]) -> None:
        with self._cond:
            self._inbox.append(op)
            self._cond.notify()

    def stop(self, grace_s: float = 0.0) -> None:
        """Refuse new requests, give in-flight ones `grace_s` to finish, cancel the rest, and end the
        thread. Blocks; idempotent."""
        with self._cond:
            self._accepting = False
            self._cond.notify()
        if self._thread is None or not self._thread.is_alive():
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self._sinks or self._inbox):
            time.sleep(0.01)
        self._post(("cancel_all",))
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (self._sinks or self._inbox):
            time.sleep(0.01)
        with self._cond:
            self._halt = True
            self._cond.notify()
        self._thread.join(timeout=5.0)

    # -- the driver thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._halt:
            try:
                gathers = self.gather.gap_s > 0 and not self.core.has_unfinished()  # idle, gathering on
                self._apply_inbox()
                if gathers and self.core.has_unfinished():
                    self._gather_burst()
                self._publish()  # before routing: a client that got its final event sees its effects
                self._route()
                ran = self.core.step()
                self._publish()
                self._route()
                if not ran:
                    self._wait()
            except Exception as exc:  # a bug somewhere: keep serving, fail what was in flight
                log.exception("driver iteration failed")
                self.core.fail(self.core.tracked_ids(), f"internal error: {type(exc).__name__}: {exc}")
                self._publish()
                self._route()
                time.sleep(0.01)  # no hot loop if the failure repeats

    def _apply_inbox(self) -> None:
        with self._cond:
            ops = list(self._inbox)
            self._inbox.clear()
        core = self.core
        for op in ops:
            kind = op[0]
            if kind == "submit":
                self._submit_isolated(op[1], op[2], op[3])
            elif kind == "abort":
                core.abort(op[1], FinishReason.CANCELLED, "cancelled by the client")
            elif kind == "ack":
                core.ack(op[1], op[2])
            elif kind == "fail":
                core.fail((op[1],), op[2])
            elif kind == "cancel_all":
                for request_id in core.tracked_ids():
                    core.abort(request_id, FinishReason.CANCELLED, "the server shut down")

    def _gather_burst(self) -> None:
        """Apply further inbox ops until none came, nor bytes on the HTTP side where
        `gather.last_activity` tells, for `gather.gap_s`; or until `gather.max_s` passed (wall
        time: `threading.Condition.wait`), or the driver is halting."""
        gap_s, last_activity = self.gather.gap_s, self.gather.last_activity
        deadline = time.monotonic() + self.gather.max_s
        last_op = time.monotonic()  # (the burst's first submission was applied just before)
        while True:
            latest = last_op if last_activity is None else max(last_op, last_activity())
            wait_s = min(latest + gap_s, deadline) - time.monotonic()
            if wait_s <= 0:
                return
            with self._cond:
                if not self._inbox and not self._halt:
                    self._cond.wait(wait_s)
                if self._halt:
                    return
                more = bool(self._inbox)
            if more:
                self._apply_inbox()
                last_op = time.monotonic()

    def _submit_isolated(self, sub: Submission, loop: asyncio.AbstractEventLoop, sink: EventSink) -> None:
        """`_apply_submit`, so that whatever goes wrong ends this submission alone, with an event."""
        try:
            self._apply_submit(sub, loop, sink)
        except Exception as exc:
            log.exception("submission %s failed", sub.request_id)
            self._sinks.pop(sub.request_id, None)
            if self.core.in_use(sub.request_id):
                self.core.fail((sub.request_id,), f"internal error: {type(exc).__name__}: {exc}")
            else:
                self._reject(
                    sub, (loop, sink), self._clock(), "internal", f"internal error: {type(exc).__name__}: {exc}"
                )

    def _apply_submit(self, sub: Submission, loop: asyncio.AbstractEventLoop, sink: EventSink) -> None:
        now = self._clock()
        rid = sub.request_id
        if rid in self._sinks or self.core.in_use(rid):
            self._reject(sub, (loop, sink), now, "duplicate_id", f"request id {rid!r} is already in use")
            return
        try:
            request = self.intake.request(
                rid, sub.prompt_token_ids, sub.params, arrival_ts=min(sub.arrival_ts, now), priority=sub.priority,
                tenant=sub.tenant,
            )  # fmt: skip
            stream = TextStream(self.backend.decoder, sub.prompt_token_ids, sub.params.stop)
        except (IntakeError, ValueError) as exc:
            self._reject(sub, (loop, sink), now, "invalid", f"{type(exc).__name__}: {exc}")
            return
        self._sinks[rid] = (loop, sink)
        self.core.add_request(request, stream)  # its first output: queued, or its rejection

    def _reject(
        self, sub: Submission, to: tuple[asyncio.AbstractEventLoop, EventSink], now: float, kind: str, detail: str
    ) -> None:
        self._rejections[kind] = self._rejections.get(kind, 0) + 1
        self._ended()
        event = RequestEvent(
            sub.request_id,
            now,
            len(sub.prompt_token_ids),
            0,
            finish_reason=FinishReason.REJECTED,
            finish_detail=detail,
            reject_kind=kind,
        )
        self._outbox.put(to[0], to[1], event)

    def _route(self) -> None:
        """Hand the loop's outputs to their sinks (the final one releases the sink)."""
        sinks = self._sinks
        for output in self.core.take_outputs():
            target = sinks.pop(output.request_id, None) if output.is_final else sinks.get(output.request_id)
            if target is not None:
                self._outbox.put(target[0], target[1], output)
                if output.is_final:
                    self._ended()
        self._outbox.flush()

    def _ended(self) -> None:
        with self._cond:
            self._num_live -= 1

    @property
    def num_live(self) -> int:
        """Submissions not yet answered with their final event (the inbox's included)."""
        return self._num_live

    def _wait(self) -> None:
        self.backend.idle()
        timer = self.core.next_timer()
        with self._cond:
            if self._inbox or self._halt:
                return
            timeout = None if timer is None else max(timer - self._clock(), 0.001)
            self._cond.wait(timeout)

    def _publish(self) -> None:
        scheduler = self.scheduler
        totals = self.core.totals
        self.snapshot = DriverSnapshot(
            ts=self._clock(),
            num_steps=totals.num_steps,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_paused=scheduler.num_paused,
            num_live=self._num_live,
            kv_usage=scheduler.kv_usage,
            num_generated_tokens=totals.num_output_tokens,
            num_padding_tokens=totals.num_padding_tokens,
            num_failed_steps=totals.num_failed_steps,
            accepting=self._accepting,
            stats=scheduler.stats.as_dict(),
            rejections=dict(self._rejections),
        )
