"""`EngineCore`: the one step loop. The simulator, the offline engine and the server's driver
thread all run their steps here; only the clock and the executor differ.

One step, in two halves (a caller may do things between them; the simulator applies the client
cancellations that happen while a step runs, a replica pool interleaves other replicas)::

    flight = core.begin_step()   # out = scheduler.schedule(now); result = executor.execute(out); end = clock
    core.end_step(flight)        # scheduler.update(out, result, end); outputs; observers

`step()` does both. The core owns, once for every driver:
- intake: `add_request` (the scheduler's decision comes back: queued, or rejected with kind
  and reason);
- finishing: a request ends in exactly one of `add_request` (rejected), `abort`, `begin_step`
  (timeouts found by `schedule`, a failed executor), `end_step` (length, the executor's stop or
  error, a stop string, a failure while producing its text);
- output processing for requests added with a `TextStream` (the engine's and the server's):
  each step's new tokens become a `RequestOutput` (incremental text, stop strings cut), the last
  one with the finish reason; a failure there ends that request alone, with ERROR;
- observers: every step is reported as a `StepRecord` (the simulator's decode runs report theirs
  through `observe`), every request added with a stream with `on_finished` when it ends.

Requests added without a stream (the simulator's) produce no outputs: their timelines are the
result.

Invariants: every tracked request gets exactly one final output; outputs of one request are in
order; the executor sees every output that carries anything for it, in order, and an output
with no chunks costs no time; `totals` counts every step taken (decode runs included).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contbatch.core.base import SchedulerBase
from contbatch.core.outputs import AddDecision, SchedulerOutput, StepResult, TokenLogprobs
from contbatch.core.request import Request
from contbatch.core.status import FinishReason
from contbatch.loop.clock import Clock
from contbatch.loop.executor import Executor, StepError, has_bookkeeping
from contbatch.loop.observe import StepObserver, StepRecord, StepTotals
from contbatch.loop.text import TextStream  # (at run time: compiled, a dataclass's field types must resolve)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced since its previous output; the last one has `finish_reason`."""

    request_id: str
    ts: float  # the loop's clock: the step's end (or when it finished)
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, this output's tokens included
    token_ids: tuple[int, ...] = ()  # new output token ids
    text: str = ""  # new text (stop strings cut out)
    queued: bool = False  # the request's first output when the scheduler queued it (no tokens yet)
    finish_reason: FinishReason | None = None  # the final output only
    finish_detail: str = ""  # why, in words (REJECTED, TIMEOUT, ERROR, CANCELLED)
    reject_kind: str = ""  # REJECTED only: the scheduler's kind (queue_full, max_model_len, ...)
    # with SamplingParams.logprobs: one entry per token of token_ids (the executor's StepResult)
    logprobs: tuple[TokenLogprobs, ...] = ()
    # with SamplingParams.prompt_logprobs: one per prompt token (None for the first), in the
    # output that carries the first tokens
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Flight:
    """A step between `begin_step` and `end_step`: its output, the executor's result (None when
    the executor failed: its requests ended already), its start and end on the loop's clock, and
    the KV usage while it ran."""

    out: SchedulerOutput
    result: StepResult | None
    start_ts: float
    end_ts: float
    kv_usage: float


@dataclass(slots=True, eq=False)
class _Tracked:
    request: Request
    stream: TextStream
    num_reported: int = 0  # output tokens already in outputs


class EngineCore:
    def __init__(
        self,
        scheduler: SchedulerBase,
        executor: Executor,
        clock: Clock,
        *,
        observers: Sequence[StepObserver] = (),
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.observers: list[StepObserver] = list(observers)
        self.totals = StepTotals()
        self._tracked: dict[str, _Tracked] = {}
        self._outputs: list[RequestOutput] = []

    # -- requests --------------------------------------------------------------------------------
    def add_request(
        self, request: Request, stream: TextStream | None = None, *, at: float | None = None
    ) -> AddDecision:
        """Hand `request` to the scheduler now (or `at` that time: a simulated arrival). With a
        `stream` its outputs are produced (a rejection at once, as its final output; else a first
        output with `queued`). ValueError for an id still in use."""
        rid = request.request_id
        if rid in self._tracked:
            raise ValueError(f"request id {rid!r} is already in use")
        now = self.clock.now() if at is None else at
        decision = self.scheduler.add_request(request, now)
        if stream is not None:
            tracked = _Tracked(request, stream)
            if decision.queued:
                self._tracked[rid] = tracked
                self._outputs.append(RequestOutput(rid, now, request.num_prompt_tokens, 0, queued=True))
            else:
                self._final(tracked, reject_kind=decision.reject_kind)
        return decision

    def abort(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.CANCELLED,
        detail: str = "cancelled by the client",
        *,
        at: float | None = None,
    ) -> bool:
        """End an unfinished request now, or `at` that time (a simulated client's own), its KV
        freed in this call; False if unknown or done."""
        found = self.scheduler.cancel(request_id, self.clock.now() if at is None else at, reason, detail=detail)
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.request.is_finished:
            self._final(tracked, flush=True)
        return found

    def ack(self, request_id: str, num_tokens: int, *, at: float | None = None) -> None:
        """The client took `num_tokens` more output tokens (output credits), now or `at`."""
        self.scheduler.ack(request_id, num_tokens, self.clock.now() if at is None else at)

    def in_use(self, request_id: str) -> bool:
        """Whether `request_id` names a request that has not finished."""
        return request_id in self._tracked or self.scheduler.contains(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def next_timer(self) -> float | None:
        """When a timeout or a pause limit fires by itself (an idle driver wakes up then)."""
        return self.scheduler.next_timer()

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs produced since the previous call, in order."""
        outputs, self._outputs = self._outputs, []
        return outputs

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    def tracked_ids(self) -> list[str]:
        return list(self._tracked)

    # -- steps -----------------------------------------------------------------------------------
    def step(self) -> bool:
        """One whole step; False when there was nothing to run."""
        flight = self.begin_step()
        if flight is None:
            return False
        self.end_step(flight)
        return True

    def begin_step(self) -> Flight | None:
        """Schedule at the clock's now and execute; None when nothing was scheduled (bookkeeping
        still reaches the executor, at no time)."""
        scheduler = self.scheduler
        start = self.clock.now()
        out = scheduler.schedule(start)
        if self._tracked and out.finished_ids:
            self._finish_ids(out.finished_ids)  # timeouts found by schedule()
        if out.is_empty:
            if has_bookkeeping(out):
                self._execute(out)
            return None
        kv_usage = scheduler.kv_usage
        result = self._execute(out)
        return Flight(out, result, start, self.clock.step_end(out, start), kv_usage)

    def end_step(self, flight: Flight) -> list[Request]:
        """Apply a step's result at its end; the requests it finished."""
        out, end = flight.out, flight.end_ts
        if flight.result is None:
            self.totals.num_failed_steps += 1
            done: list[Request] = []
        else:
            self.totals.add(out, flight.start_ts, end, flight.kv_usage)
            try:
                done = self.scheduler.update(out, flight.result, end)
            except Exception as exc:  # a result the scheduler cannot apply: that step's requests end
                self._fail_step(out, exc)
                done = []
            if self._tracked:
                self._process(out, done, end, flight.result)
        if self.observers:
            self.observe(StepRecord(out, flight.start_ts, end, flight.kv_usage, _num_sampled(flight.result)))
        return done

    def observe(self, record: StepRecord) -> None:
        """Report a step to every observer (steps taken outside `step`, by decode runs, too)."""
        for observer in self.observers:
            try:
                observer.on_step(record)
            except Exception:  # an observer must never fail requests
                log.exception("step observer failed")

    # -- inside a step ---------------------------------------------------------------------------
    def _execute(self, out: SchedulerOutput) -> StepResult | None:
        try:
            return self.executor.execute(out)
        except Exception as exc:
            self._fail_step(out, exc)
            return None

    def _fail_step(self, out: SchedulerOutput, exc: BaseException) -> None:
        cause = exc.cause if isinstance(exc, StepError) else exc
        log.error("step %d failed: %s: %s", out.step_id, type(cause).__name__, cause, exc_info=exc)
        ids = exc.request_ids if isinstance(exc, StepError) else [c.request_id for c in out.chunks]
        detail = f"the executor failed in step {out.step_id}: {type(cause).__name__}: {cause}"
        self.fail(ids, detail)

    def fail(self, request_ids: Iterable[str], detail: str) -> None:
        """End each of `request_ids` still unfinished with ERROR (and `detail`)."""
        now = self.clock.now()
        for rid in list(request_ids):
            try:
                self.scheduler.cancel(rid, now, FinishReason.ERROR, detail=detail)
            except Exception:  # its scheduler state is broken: end it here anyway
                log.exception("could not fail %s in the scheduler", rid)
            tracked = self._tracked.get(rid)
            if tracked is not None:
                self._final(tracked, reason=FinishReason.ERROR, detail=detail, ts=now)

    def _process(self, out: SchedulerOutput, done: list[Request], now: float, result: StepResult | None = None) -> None:
        """Each tracked request of the step: its new tokens as text, stop strings, its end."""
        tracked = self._tracked
        for chunk in out.chunks:
            entry = tracked.get(chunk.request_id)
            if entry is not None and chunk.samples:
                try:
                    self._deliver(entry, now, result)
                except Exception as exc:  # detokenization or a stop check failed: this request alone
                    log.exception("output processing failed for %s", chunk.request_id)
                    self.fail((chunk.request_id,), f"its output could not be processed: {type(exc).__name__}: {exc}")
        for request in done:
            entry = tracked.get(request.request_id)
            if entry is not None:  # ended without sampling this step (an executor error)
                self._final(entry, flush=True)

    def _deliver(self, entry: _Tracked, now: float, result: StepResult | None = None) -> None:
        request = entry.request
        new = tuple(request.output_token_ids[entry.num_reported :])
        entry.num_reported = request.num_output_tokens
        self.totals.num_output_tokens += len(new)
        if not new and not request.is_finished:
            return
        logprobs: tuple[TokenLogprobs, ...] = ()
        prompt_logprobs = None
        if result is not None and (result.logprobs or result.prompt_logprobs):  # the engine, when asked
            logprobs = (result.logprobs or {}).get(request.request_id, ())[: len(new)]
            prompt_logprobs = (result.prompt_logprobs or {}).get(request.request_id)
        delta = entry.stream.add(new) if new else None
        text = delta.text if delta is not None else ""
        if delta is not None and delta.stopped:
            if not request.is_finished:
                self.scheduler.cancel(request.request_id, now, FinishReason.STOP)
            self._final(entry, token_ids=new, text=text, reason=FinishReason.STOP, logprobs=(logprobs, prompt_logprobs))
        elif request.is_finished:
            self._final(entry, token_ids=new, text=text, flush=True, logprobs=(logprobs, prompt_logprobs))
        else:
            self._outputs.append(
                RequestOutput(
                    request.request_id,
                    now,
                    request.num_prompt_tokens,
                    request.num_output_tokens,
                    new,
                    text,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
            )

    def _finish_ids(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            entry = self._tracked.get(rid)
            if entry is not None and entry.request.is_finished:
                self._final(entry, flush=True)

    def _final(
        self,
        entry: _Tracked,
        *,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        flush: bool = False,
        reason: FinishReason | None = None,
        detail: str | None = None,
        ts: float | None = None,
        reject_kind: str = "",
        logprobs: tuple[tuple[TokenLogprobs, ...], tuple[TokenLogprobs | None, ...] | None] = ((), None),
    ) -> None:
        """The request's final output: `text`, plus (`flush`) what its stream held back."""
        request = entry.request
        self._tracked.pop(request.request_id, None)
        if flush:
            try:
                text += entry.stream.finish()
            except Exception:  # the held-back tail is lost; the request still ends, once
                log.exception("the text stream of %s failed at its end", request.request_id)
        finished_ts = request.timeline.finished_ts
        final = RequestOutput(
            request.request_id,
            finished_ts if finished_ts is not None else (ts if ts is not None else self.clock.now()),
            request.num_prompt_tokens,
            request.num_output_tokens,
            token_ids,
            text,
            finish_reason=reason or request.finish_reason or FinishReason.ERROR,
            finish_detail=request.finish_detail if detail is None else detail,
            reject_kind=reject_kind,
            logprobs=logprobs[0],
            prompt_logprobs=logprobs[1],
        )
        self._outputs.append(final)
        if request.is_finished and self.observers:
            self._notify_finished(request, final)

    def _notify_finished(self, request: Request, final: RequestOutput) -> None:
        for observer in self.observers:
            try:
                observer.on_finished(request, final)
            except Exception:  # an observer must never fail requests
                log.exception("observer on_finished failed for %s", request.request_id)


def _num_sampled(result: StepResult | None) -> int:
    return sum(len(t) for t in result.sampled_token_ids.values()) if result is not None else 0
