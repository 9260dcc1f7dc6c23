"""`EngineClient`: the asynchronous interface the HTTP layer talks to, and its one implementation.

The HTTP layer never sees the scheduler or the executor: it gets token ids through the client
(the step loop's intake), hands
it a `Submission` and reads a `RequestStream` (an async iterator of `RequestEvent`s). Streams
acknowledge what their reader took (`ack`, which frees output credits) and can be aborted (the
request is cancelled at the next step boundary, its KV freed then).

`DriverClient` implements it over a `Driver` running a backend's executor; which backend (the
paced simulator or the real engine) is decided when it is built (`contbatch.server.backends`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from contbatch.core.config import SchedulerConfig
from contbatch.server.backends.base import Backend, ChatMessage, PromptBound
from contbatch.server.driver import NO_GATHER, Driver, Gather
from contbatch.server.metrics import ServerMetrics
from contbatch.server.types import DriverSnapshot, RequestEvent, Submission


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # the model id clients must name
    backend: str  # "sim" or "engine"
    max_model_len: int | None  # prompt + output tokens at most; None: no limit
    vocab_size: int | None
    created: int  # unix seconds, when the server started
    # request fields the backend cannot honour -> why (a request asking for one gets a 400)
    unsupported: Mapping[str, str] = field(default_factory=dict)
    kv_capacity_tokens: int | None = None  # prompt + output tokens the KV cache can hold; None: no limit


@dataclass(frozen=True, slots=True)
class Health:
    ok: bool
    detail: str


class RequestStream:
    """The events of one request: `first()` (queued, or the final rejection), then the rest by
    `async for`. Lives on the event loop that created it."""

    def __init__(self, request_id: str, client: EngineClient) -> None:
        self.request_id = request_id
        self._client = client
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._peeked: RequestEvent | None = None
        self.final: RequestEvent | None = None  # the final event, once read

    def push(self, event: RequestEvent) -> None:
        self._queue.put_nowait(event)

    async def first(self) -> RequestEvent:
        """The first event; a final one (rejected) is also what iteration yields next."""
        event = await self._queue.get()
        if not event.queued:
            self._peeked = event
        return event

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestEvent:
        while self.final is None:
            if self._peeked is not None:
                event, self._peeked = self._peeked, None
            else:
                event = await self._queue.get()
            if event.queued:
                continue
            if event.is_final:
                self.final = event
            return event
        raise StopAsyncIteration

    @property
    def finished(self) -> bool:
        return self.final is not None

    def ack(self, num_tokens: int) -> None:
        if num_tokens > 0 and self.final is None:
            self._client.ack(self.request_id, num_tokens)

    def abort(self) -> None:
        """Cancel the request unless its final event was read (then: nothing to do)."""
        if self.final is None:
            self._client.abort(self.request_id)

    def fail(self, detail: str) -> None:
        """End the request with an error (its output could not be delivered) unless its final
        event was read."""
        if self.final is None:
            self._client.fail(self.request_id, detail)


class EngineClient(Protocol):
    @property
    def model(self) -> ModelInfo: ...

    def now(self) -> float: ...  # the clock of arrival timestamps and events

    def prompt_ids(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        """Token ids of a prompt (text tokenized, ids checked); `IntakeError` when it has none or
        holds an id outside the vocabulary."""
        ...

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]: ...  # unchecked: see prompt_ids

    def min_prompt_tokens(self, text: str, *, stop_at: int | None = None) -> int:
        """A lower bound on the tokens of `text`, without tokenizing it (0 when the backend has
        none); it may stop counting at `stop_at`."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...  # thread-safe

    def generate(self, submission: Submission) -> RequestStream:
        """Submit on the running event loop; `DriverClosed` when the server is shutting down."""
        ...

    def abort(self, request_id: str) -> None: ...

    def fail(self, request_id: str, detail: str) -> None: ...  # ends it with an error (delivery failed)

    def ack(self, request_id: str, num_tokens: int) -> None: ...

    def health(self) -> Health: ...

    def snapshot(self) -> DriverSnapshot: ...

    def render_metrics(self) -> bytes: ...  # Prometheus text format

    def count_http_error(self, status: int) -> None: ...  # an HTTP response with an error status

    def start(self) -> None: ...

    def shutdown(self, grace_s: float) -> None: ...  # blocking


class DriverClient:
    """The `EngineClient` over a `Driver` and a backend."""

    def __init__(self, backend: Backend, *, scheduler: str = "continuous", gather: Gather = NO_GATHER) -> None:
        self.backend = backend
        self.driver = Driver(backend, scheduler=scheduler, gather=gather)
        self.metrics = ServerMetrics(lambda: self.driver.snapshot, model_name=backend.model_name)
        self.driver.core.observers.append(self.metrics)
        self._model = ModelInfo(
            name=backend.model_name,
            backend=backend.name,
            max_model_len=backend.config.max_model_len,
            vocab_size=backend.vocab_size,
            created=int(time.time()),
            unsupported=dict(getattr(backend, "unsupported_fields", {})),
            kv_capacity_tokens=_kv_capacity(self.driver.scheduler.config),
        )

    @property
    def model(self) -> ModelInfo:
        return self._model

    def now(self) -> float:
        return self.driver.now()

    def prompt_ids(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        return self.driver.intake.prompt_ids(prompt)

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
        return self.backend.chat_prompt_ids(messages)

    def min_prompt_tokens(self, text: str, *, stop_at: int | None = None) -> int:
        backend = self.backend
        return backend.min_prompt_tokens(text, stop_at=stop_at) if isinstance(backend, PromptBound) else 0

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decoder.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def generate(self, submission: Submission) -> RequestStream:
        stream = RequestStream(submission.request_id, self)
        self.driver.submit(submission, asyncio.get_running_loop(), stream.push)
        return stream

    def abort(self, request_id: str) -> None:
        self.driver.abort(request_id)

    def fail(self, request_id: str, detail: str) -> None:
        self.driver.fail(request_id, detail)

    def ack(self, request_id: str, num_tokens: int) -> None:
        self.driver.ack(request_id, num_tokens)

    def health(self) -> Health:
        if not self.driver.is_alive:
            return Health(False, "the step driver is not running")
        if not self.driver.accepting:
            return Health(False, "shutting down")
        return Health(True, "ok")

    def snapshot(self) -> DriverSnapshot:
        # the live count as of now: a submission still in the driver's inbox counts
        return dataclasses.replace(self.driver.snapshot, num_live=self.driver.num_live)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def count_http_error(self, status: int) -> None:
        self.metrics.count_http_error(status)

    def start(self) -> None:
        if not self.driver.is_alive:
            self.driver.start()

    def shutdown(self, grace_s: float) -> None:
        self.driver.stop(grace_s)
        self.backend.close()


def _kv_capacity(config: SchedulerConfig) -> int | None:
    """Tokens the KV cache holds (prompt + output of one request at most); None without a KV budget."""
    kv = config.kv
    return None if kv is None else kv.num_blocks * kv.block_size
