"""The step driver: the scheduler loop of DESIGN.md section 2 on one background thread, in real time.

One thread owns the scheduler and the executor; nothing else touches them. Each iteration::

    apply the inbox (submissions, cancellations, acks)     # only at step boundaries
    out = scheduler.schedule(now); result = executor.execute(out); scheduler.update(out, result, now_after)
    deliver each request's new tokens as a `RequestEvent` to its asyncio sink

`now` is the driver's clock (`time.monotonic()` by default). The asyncio side calls `submit`,
`abort` and `ack` from any thread: they append to a locked inbox and wake the thread. Events go
back with `loop.call_soon_threadsafe`, batched per event loop, once after the inbox is applied and
once after each step. With nothing to run the thread sleeps until a submission or the scheduler's
next timer (`scheduler.next_timer()`: timeouts, paused streams).

Failure isolation: if `execute` (or `update`) raises, only the requests of that step end, with
finish reason ERROR; the loop keeps serving. An unexpected error elsewhere fails the requests
that were live and the loop goes on.

Stop strings are applied here, on text: the text of a request with stop strings is held back by
(longest stop - 1) characters until it cannot begin a stop string; when one is found the text
ends before it and the request is finished with STOP (its KV freed in the same call).

Shutdown (`stop`): new submissions are refused (`DriverClosed`); in-flight requests get a grace
period to finish, then the rest are cancelled (CANCELLED, "the server shut down") and the thread
exits.

Invariants: every submission gets exactly one final event; events of a request are delivered in
order; a request leaves the driver's live set in the same call that finishes it; the executor's
`release` is called once per request it was given.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from contbatch.core.base import SchedulerBase
from contbatch.core.outputs import SchedulerOutput
from contbatch.core.request import Request
from contbatch.core.status import FinishReason, RequestStatus
from contbatch.server.delivery import EventSink, LiveRequest, Outbox, cut_at_stop
from contbatch.server.executor import DriverObserver, Executor
from contbatch.server.types import DriverSnapshot, RequestEvent, Submission

log = logging.getLogger(__name__)


class DriverClosed(RuntimeError):
    """The driver no longer accepts submissions (shutting down, or stopped)."""


@dataclass(slots=True)
class _Counters:
    num_steps: int = 0
    num_generated: int = 0
    num_padding: int = 0
    num_failed_steps: int = 0


class Driver:
    def __init__(
        self,
        scheduler: SchedulerBase,
        executor: Executor,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: DriverObserver | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        bind = getattr(executor, "bind", None)
        if bind is not None:  # an executor that reads the scheduler's state (the engine's block tables)
            bind(scheduler)
        self.observer = observer
        self._clock = clock
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._outbox = Outbox()
        self._live: dict[str, LiveRequest] = {}
        self._counters = _Counters()
        self._accepting = True
        self._halt = False
        self._thread: threading.Thread | None = None
        self.snapshot = DriverSnapshot()  # replaced (never mutated) after every iteration

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
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Cancel at the next step boundary (its KV is freed then); unknown or finished: no-op."""
        self._post(("abort", request_id))

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
        while time.monotonic() < deadline and (self._live or self._inbox):
            time.sleep(0.01)
        self._post(("cancel_all",))
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (self._live or self._inbox):
            time.sleep(0.01)
        with self._cond:
            self._halt = True
            self._cond.notify()
        self._thread.join(timeout=5.0)

    # -- the driver thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._halt:
            try:
                self._apply_inbox()
                self._outbox.flush()
                ran = self._step()
                self._publish()
                if not ran:
                    self._wait()
            except Exception as exc:  # a bug somewhere: keep serving, fail what was in flight
                log.exception("driver iteration failed")
                self._fail_all(f"internal error: {type(exc).__name__}: {exc}")
                self._publish()
                time.sleep(0.01)  # no hot loop if the failure repeats

    def _apply_inbox(self) -> None:
        with self._cond:
            ops = list(self._inbox)
            self._inbox.clear()
        for op in ops:
            kind = op[0]
            if kind == "submit":
                self._apply_submit(op[1], op[2], op[3])
            elif kind == "abort":
                self._cancel(op[1], FinishReason.CANCELLED, "cancelled by the client")
            elif kind == "ack":
                self.scheduler.ack(op[1], op[2], self._clock())
            elif kind == "cancel_all":
                for request_id in list(self._live):
                    self._cancel(request_id, FinishReason.CANCELLED, "the server shut down")

    def _apply_submit(self, sub: Submission, loop: asyncio.AbstractEventLoop, sink: EventSink) -> None:
        now = self._clock()
        rid = sub.request_id
        if rid in self._live or rid in self.scheduler.requests:
            self._reject(sub, (loop, sink), now, "duplicate_id", f"request id {rid!r} is already in use")
            return
        try:
            request = Request(
                rid,
                min(sub.arrival_ts, now),
                len(sub.prompt_token_ids),
                sub.params.max_tokens,
                priority=sub.priority,
                tenant=sub.tenant,
                block_hashes=self._block_hashes(sub.prompt_token_ids),
            )
            self.executor.add_request(sub)
        except Exception as exc:
            self._reject(sub, (loop, sink), now, "invalid", f"{type(exc).__name__}: {exc}")
            return
        live = LiveRequest(request, loop, sink, sub.params.stop)
        self._live[rid] = live
        before = dict(self.scheduler.stats.rejections)
        try:
            queued = self.scheduler.add_request(request, now)
        except Exception:
            self._live.pop(rid, None)
            self.executor.release(rid)
            raise
        if queued:
            event = RequestEvent(rid, now, request.num_prompt_tokens, 0, admitted=True)
            self._outbox.put(loop, sink, event)
        else:
            self._finish_live(live, reject_kind=_new_rejection(before, self.scheduler.stats.rejections))

    def _reject(
        self, sub: Submission, to: tuple[asyncio.AbstractEventLoop, EventSink], now: float, kind: str, detail: str
    ) -> None:
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

    def _block_hashes(self, token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Chained hashes of the full prompt blocks (equal prefixes, equal hashes), for prefix caching."""
        kv = self.scheduler.config.kv
        if kv is None or not kv.enable_prefix_caching:
            return ()
        hashes: list[int] = []
        running = 0
        for start in range(0, len(token_ids) - kv.block_size + 1, kv.block_size):
            running = hash((running, token_ids[start : start + kv.block_size]))
            hashes.append(running)
        return tuple(hashes)

    def _cancel(self, request_id: str, reason: FinishReason, detail: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        self.scheduler.cancel(request_id, self._clock(), reason, detail=detail)
        self._reap((request_id,))

    def _step(self) -> bool:
        """One schedule / execute / update; False when nothing ran."""
        scheduler = self.scheduler
        if not scheduler.has_unfinished():
            return False
        start = self._clock()
        out = scheduler.schedule(start)
        self._reap(out.finished_ids)  # timeouts found by schedule()
        if out.is_empty:
            return False
        try:
            result = self.executor.execute(out)
            end = max(self._clock(), start)
            scheduler.update(out, result, end)
        except Exception as exc:
            self._fail_step(out, exc)
            return True
        counters = self._counters
        counters.num_steps += 1
        counters.num_padding += out.num_padding_tokens
        num_sampled = self._deliver(out, end)
        counters.num_generated += num_sampled
        if self.observer is not None:
            try:
                self.observer.on_step(out, end - start, num_sampled)
            except Exception:  # metrics must never fail requests
                log.exception("observer on_step failed")
        return True

    def _deliver(self, out: SchedulerOutput, now: float) -> int:
        """Send each stepped request its new tokens (and its end); returns the tokens sent."""
        total = 0
        for chunk in out.chunks:
            live = self._live.get(chunk.request_id)
            if live is None:
                continue
            request = live.request
            new = tuple(request.output_token_ids[live.num_delivered :])
            live.num_delivered = len(request.output_token_ids)
            total += len(new)
            if not new and not request.is_finished:
                continue
            text = self.executor.detokenize(request.request_id, new) if new else ""
            text, stopped = cut_at_stop(live, text, final=request.is_finished)
            if stopped and not request.is_finished:
                self.scheduler.cancel(request.request_id, now, FinishReason.STOP)
            if request.is_finished:
                self._finish_live(live, token_ids=new, text=text, stopped=stopped)
            else:
                event = RequestEvent(
                    request.request_id, now, request.num_prompt_tokens, request.num_output_tokens, new, text
                )
                self._outbox.put(live.loop, live.sink, event)
        return total

    def _reap(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is not None and live.request.is_finished:
                text = live.pending
                live.pending = ""
                self._finish_live(live, text=text)

    def _finish_live(
        self,
        live: LiveRequest,
        *,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        stopped: bool = False,
        reject_kind: str = "",
    ) -> None:
        request = live.request
        reason = FinishReason.STOP if stopped else request.finish_reason
        event = RequestEvent(
            request.request_id,
            request.timeline.finished_ts if request.timeline.finished_ts is not None else self._clock(),
            request.num_prompt_tokens,
            request.num_output_tokens,
            token_ids,
            text,
            finish_reason=reason if reason is not None else FinishReason.ERROR,
            finish_detail=request.finish_detail,
            reject_kind=reject_kind,
        )
        self._live.pop(request.request_id, None)
        self._outbox.put(live.loop, live.sink, event)
        try:
            self.executor.release(request.request_id)
        finally:
            if self.observer is not None and request.is_finished:
                try:
                    self.observer.on_finished(request)
                except Exception:  # metrics must never fail requests
                    log.exception("observer on_finished failed for %s", request.request_id)

    def _fail_step(self, out: SchedulerOutput, exc: BaseException) -> None:
        log.error("step %d failed: %s: %s", out.step_id, type(exc).__name__, exc, exc_info=exc)
        self._counters.num_failed_steps += 1
        detail = f"the executor failed in step {out.step_id}: {type(exc).__name__}: {exc}"
        self._fail(self.scheduler.requests.keys() & {c.request_id for c in out.chunks}, detail)

    def _fail_all(self, detail: str) -> None:
        self._fail(list(self._live), detail)

    def _fail(self, request_ids: Iterable[str], detail: str) -> None:
        now = self._clock()
        for request_id in list(request_ids):
            live = self._live.get(request_id)
            try:
                self.scheduler.cancel(request_id, now, FinishReason.ERROR, detail=detail)
            except Exception:  # the scheduler's state is broken for it: end it here anyway
                log.exception("could not fail %s in the scheduler", request_id)
            if live is None:
                continue
            if live.request.is_finished:
                self._reap((request_id,))
            else:
                self._live.pop(request_id, None)
                event = RequestEvent(
                    request_id,
                    now,
                    live.request.num_prompt_tokens,
                    live.request.num_output_tokens,
                    finish_reason=FinishReason.ERROR,
                    finish_detail=detail,
                )
                self._outbox.put(live.loop, live.sink, event)
        self._outbox.flush()

    def _wait(self) -> None:
        self.executor.idle()
        timer = self.scheduler.next_timer()
        with self._cond:
            if self._inbox or self._halt:
                return
            timeout = None if timer is None else max(timer - self._clock(), 0.001)
            self._cond.wait(timeout)

    def _publish(self) -> None:
        self._outbox.flush()
        scheduler = self.scheduler
        running = scheduler.running
        counters = self._counters
        self.snapshot = DriverSnapshot(
            ts=self._clock(),
            num_steps=counters.num_steps,
            num_running=len(running),
            num_waiting=len(scheduler.waiting),
            num_paused=sum(1 for r in running if r.paused_since is not None and r.status is RequestStatus.RUNNING),
            num_live=len(self._live),
            kv_usage=scheduler.kv_usage,
            num_generated_tokens=counters.num_generated,
            num_padding_tokens=counters.num_padding,
            num_failed_steps=counters.num_failed_steps,
            accepting=self._accepting,
            stats=scheduler.stats.as_dict(),
        )


def _new_rejection(before: dict[str, int], after: dict[str, int]) -> str:
    """The reject kind whose count grew (the scheduler's reason for the latest rejection)."""
    for kind, count in after.items():
        if count > before.get(kind, 0):
            return kind
    return "rejected"
