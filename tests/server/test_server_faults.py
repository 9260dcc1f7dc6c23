"""Per-request fault isolation at every stage (issue 15): a failure in one request's validation,
tokenization, scheduling, forward pass, sampling, detokenization, stop check or delivery ends
that request alone, with a clear error (an OpenAI error JSON, or an SSE error event once its
stream has started), counted in /metrics, while concurrent healthy streams complete with their
full output and /health stays 200.

Each test serves a real server on 127.0.0.1 with one injected fault (a small wrapper around the
tokenizer, the scheduler, the executor, the sampler, the decoder, the stop check, the event sink
or the SSE writer) that fires for the poisoned request only: the one sent with `POISON_SEED`,
the word `POISON`, the token `POISON_TOKEN`, or over chat while the healthy ones use completions.
`HealthyStreams` starts the healthy streams and waits until all are running before the poisoned
request is sent, and the test checks that none had finished when the poisoned request's error
came back: the failure happened while they were in flight.

One failure is, by the executor contract, not one request's: an executor that raises a plain
exception (not `StepError`) fails every request of that step; the test shows that and that the
server goes on serving. The sampler's failures are attributed: the engine's runner samples each
request of the failed step alone to find the one that fails (`contbatch.engine.runner`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from contbatch.core import PRESETS, SchedulerConfig
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.engine.sampling import History, Prepared, Sampler
from contbatch.loop.executor import StepError
from contbatch.loop.params import SamplingParams
from contbatch.loop.text import Decoder, StopChecker, TextStream
from contbatch.server.backends import BackendOptions, make_backend
from contbatch.server.backends.base import ChatMessage
from contbatch.server.backends.sim import OUTPUT_WORD, SimBackend
from contbatch.server.client import DriverClient, RequestStream
from contbatch.server.types import RequestEvent, Submission
from server.harness import MODEL, RunningServer, sim_backend, start_server

POISON_SEED = 666
POISON_TOKEN = 31_999  # the sim's vocabulary is 32,000
NUM_HEALTHY = 4
HEALTHY_TOKENS = 60  # 60 steps of 10 ms: the healthy streams outlast the poisoned request
COST = "affine:base_ms=10"
HEALTHY = {"model": MODEL, "prompt": "a b c", "max_tokens": HEALTHY_TOKENS, "ignore_eos": True}
POISONED = {"model": MODEL, "prompt": "x y", "max_tokens": 8, "ignore_eos": True}


# -- clients ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one client got: the status, the text, the finish reason, the error (JSON or SSE)."""

    status: int
    text: str = ""
    finish: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False  # the stream ended with [DONE]
    num_tokens: int = 0  # usage.completion_tokens


def call(server: RunningServer, body: dict[str, Any], *, chat: bool = False, stream: bool = False) -> Outcome:
    """One request; a stream is read to its end."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = server.post(path, json=body)
        data = r.json()
        if r.status_code != 200:
            return Outcome(r.status_code, error=data["error"])
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return Outcome(200, text, choice["finish_reason"], num_tokens=data["usage"]["completion_tokens"])
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = Outcome(0)
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as r:
        out.status = r.status_code
        if r.status_code != 200:
            r.read()
            out.error = r.json()["error"]
            return out
        parts: list[str] = []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                continue
            if event.get("usage"):
                out.num_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                parts.append((choice["delta"].get("content") or "") if chat else choice["text"])
                out.finish = choice["finish_reason"] or out.finish
        out.text = "".join(parts)
    return out


@dataclass
class HealthyStreams:
    """`NUM_HEALTHY` streams of `HEALTHY`, each on its own thread."""

    server: RunningServer
    body: dict[str, Any]
    outcomes: list[Outcome | BaseException | None] = field(default_factory=list)
    finished: list[threading.Event] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(NUM_HEALTHY):
            self.outcomes.append(None)
            self.finished.append(threading.Event())
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            self.threads.append(thread)
            thread.start()
        deadline = time.monotonic() + 30
        while self.server.client.snapshot().num_running < NUM_HEALTHY:  # all of them in flight
            assert time.monotonic() < deadline, "the healthy streams did not start"
            assert not any(e.is_set() for e in self.finished), self.outcomes
            time.sleep(0.002)

    def _run(self, i: int) -> None:
        try:
            self.outcomes[i] = call(self.server, self.body, stream=True)
        except BaseException as exc:  # reported by join()
            self.outcomes[i] = exc
        finally:
            self.finished[i].set()

    def in_flight(self) -> bool:
        return not any(e.is_set() for e in self.finished)

    def join(self) -> list[Outcome]:
        for thread in self.threads:
            thread.join(timeout=60)
        done = [o for o in self.outcomes if isinstance(o, Outcome)]
        assert len(done) == NUM_HEALTHY, self.outcomes
        return done


@contextmanager
def healthy_streams(server: RunningServer, body: dict[str, Any] | None = None) -> Iterator[HealthyStreams]:
    streams = HealthyStreams(server, body or HEALTHY)
    streams.start()
    yield streams


def assert_completed(outcomes: Sequence[Outcome], text: str | None = OUTPUT_WORD * HEALTHY_TOKENS) -> None:
    """Every healthy stream ran to its length, with its whole text and its usage."""
    for out in outcomes:
        assert out.status == 200 and out.error is None and out.done, out
        assert out.finish == "length" and out.num_tokens == HEALTHY_TOKENS, out
        if text is not None:
            assert out.text == text, out


def poison_then_check(
    server: RunningServer, send: Callable[[], Outcome], body: dict[str, Any] | None = None
) -> tuple[Outcome, list[Outcome]]:
    """Healthy streams in flight, the poisoned request sent (its answer back while they still
    run), then the healthy ones to their end; the server healthy and idle afterwards."""
    with healthy_streams(server, body) as streams:
        poisoned = send()
        assert streams.in_flight(), "the healthy streams ended before the poisoned request did"
        healthy = streams.join()
    assert server.get("/health").status_code == 200
    server.wait_idle()
    assert not server.scheduler.requests
    return poisoned, healthy


# -- metrics --------------------------------------------------------------------------------------
def metrics(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def failed(server: RunningServer) -> dict[str, float]:
    """request_failed_total by stage."""
    return {
        dict(labels)["stage"]: value
        for (name, labels), value in metrics(server).items()
        if name == "contbatch:request_failed_total"
    }


def http_errors(server: RunningServer) -> dict[str, float]:
    """http_request_errors_total by status, the nonzero ones."""
    return {
        dict(labels)["status"]: value
        for (name, labels), value in metrics(server).items()
        if name == "contbatch:http_request_errors_total" and value
    }


def success(server: RunningServer) -> float:
    m = metrics(server)
    return m[("contbatch:request_success_total", (("finished_reason", "length"),))]


def only_failures(server: RunningServer, **stages: float) -> None:
    """request_failed_total is `stages` (every other stage 0) and every healthy request succeeded."""
    assert failed(server) == {s: stages.get(s, 0.0) for s in ("step", "output", "delivery", "internal", "other")}


# -- validation and tokenization (the HTTP layer) ---------------------------------------------------
def test_validation_a_bad_request_is_a_400_and_the_streams_go_on(make_server: Any) -> None:
    server: RunningServer = make_server(cost=COST)
    poisoned, healthy = poison_then_check(server, lambda: call(server, {**POISONED, "temperature": 5}))
    assert poisoned.status == 400 and poisoned.error is not None and poisoned.error["param"] == "temperature"
    assert_completed(healthy)
    assert http_errors(server) == {"400": 1}
    only_failures(server)
    assert success(server) == NUM_HEALTHY


class PoisonTokenizer(SimBackend):
    """The sim, whose tokenizer raises on a text holding the word POISON (its chat template too)."""

    def tokenize(self, text: str) -> tuple[int, ...]:
        if "POISON" in text:
            raise RuntimeError("simulated tokenizer fault")
        return super().tokenize(text)

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
        if any("POISON" in m.content for m in messages):
            raise RuntimeError("simulated chat template fault")
        return super().chat_prompt_ids(messages)


def poison_tokenizer_backend() -> PoisonTokenizer:
    sim = sim_backend(COST)
    return PoisonTokenizer(sim.executor.cost, sim.config, model_name=MODEL)


@pytest.mark.parametrize(
    ("chat", "body"),
    [
        (False, {**POISONED, "prompt": "a POISON b"}),
        (False, {**POISONED, "prompt": "POISON " + "w " * 4500}),  # a long prompt: on the tokenizer pool
        (True, {**POISONED, "prompt": None, "messages": [{"role": "user", "content": "POISON"}]}),
    ],
    ids=["short prompt", "long prompt", "chat"],
)
def test_tokenization_a_tokenizer_that_raises_fails_its_request_alone(
    make_server: Any, chat: bool, body: dict[str, Any]
) -> None:
    server: RunningServer = make_server(backend=poison_tokenizer_backend())
    poisoned, healthy = poison_then_check(server, lambda: call(server, body, chat=chat))
    assert poisoned.status == 500 and poisoned.error is not None
    assert poisoned.error["code"] == "tokenization_failed" and poisoned.error["param"] == (
        "messages" if chat else "prompt"
    )
    assert "could not be tokenized" in poisoned.error["message"] and "simulated" in poisoned.error["message"]
    assert_completed(healthy)
    assert http_errors(server) == {"500": 1}
    only_failures(server)


# -- scheduling (the driver) ----------------------------------------------------------------------
@pytest.mark.interpreted  # replaces the scheduler's add_request on the instance
def test_scheduling_a_scheduler_that_raises_on_one_request_rejects_it_alone(make_server: Any) -> None:
    server: RunningServer = make_server(cost=COST)
    scheduler = server.scheduler
    add_request = scheduler.add_request

    def poisoned_add(request: Any, now: float) -> Any:
        if request.params.seed == POISON_SEED:
            raise RuntimeError("simulated scheduler fault")
        return add_request(request, now)

    scheduler.add_request = poisoned_add  # the driver thread calls it at the next step boundary
    poisoned, healthy = poison_then_check(server, lambda: call(server, {**POISONED, "seed": POISON_SEED}))
    assert poisoned.status == 500 and poisoned.error is not None
    assert poisoned.error["type"] == "server_error" and "simulated scheduler fault" in poisoned.error["message"]
    assert_completed(healthy)
    m = metrics(server)
    assert m[("contbatch:request_rejected_total", (("reason", "internal"),))] == 1
    assert http_errors(server) == {"500": 1}
    only_failures(server)


# -- the forward pass (the executor) ----------------------------------------------------------------
class FaultyExecutor:
    """Runs the sim's step, then fails it for the poisoned requests (seed `POISON_SEED`): with a
    `StepError` naming them, or (`whole_step`) with a plain exception, which concerns the whole
    step. Either way the step's result is discarded."""

    def __init__(self, inner: Any, *, whole_step: bool = False) -> None:
        self.inner = inner
        self.whole_step = whole_step
        self.poisoned: set[str] = set()

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.poisoned |= {n.request_id for n in out.new_requests if getattr(n.params, "seed", None) == POISON_SEED}
        result: StepResult = self.inner.execute(out)  # its bookkeeping applied, its time spent
        hit = [c.request_id for c in out.chunks if c.request_id in self.poisoned]
        if hit and self.whole_step:
            raise RuntimeError("simulated device fault")
        if hit:
            raise StepError(hit, RuntimeError("simulated device fault"))
        return result

    def idle(self) -> None:
        self.inner.idle()


def faulty_backend(*, whole_step: bool = False) -> SimBackend:
    backend = sim_backend(COST)
    backend.executor = FaultyExecutor(backend.executor, whole_step=whole_step)  # type: ignore[assignment]
    return backend


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_forward_a_step_error_for_one_request_fails_it_alone(make_server: Any, stream: bool) -> None:
    server: RunningServer = make_server(backend=faulty_backend())
    poisoned, healthy = poison_then_check(
        server, lambda: call(server, {**POISONED, "seed": POISON_SEED}, stream=stream)
    )
    if stream:  # the stream had started (its 200 sent when the scheduler queued it): an error event
        assert poisoned.status == 200 and poisoned.done and poisoned.text == ""
    else:
        assert poisoned.status == 500
    assert poisoned.error is not None and poisoned.error["type"] == "server_error"
    assert "the executor failed in step" in poisoned.error["message"]
    assert "simulated device fault" in poisoned.error["message"]
    assert_completed(healthy)  # they shared the failed step: it was redone for them
    only_failures(server, step=1)
    assert server.client.snapshot().num_failed_steps == 1
    assert http_errors(server) == ({} if stream else {"500": 1})


def test_forward_a_plain_exception_fails_the_whole_step_and_the_server_goes_on(make_server: Any) -> None:
    """The executor contract: an exception that names no request concerns every request of its
    step. The healthy streams shared the poisoned request's step, so they fail with it; the
    server keeps serving the requests that come after."""
    server: RunningServer = make_server(backend=faulty_backend(whole_step=True))
    with healthy_streams(server) as streams:
        poisoned = call(server, {**POISONED, "seed": POISON_SEED})
        failed_too = streams.join()
    assert poisoned.status == 500 and poisoned.error is not None
    assert "simulated device fault" in poisoned.error["message"]
    for out in failed_too:
        assert out.status == 200 and out.done and out.error is not None
        assert "simulated device fault" in out.error["message"] and out.num_tokens < HEALTHY_TOKENS
    assert server.get("/health").status_code == 200
    after = [call(server, {**HEALTHY, "max_tokens": 3}) for _ in range(2)]
    assert all(o.status == 200 and o.text == OUTPUT_WORD * 3 for o in after), after
    server.wait_idle()
    only_failures(server, step=NUM_HEALTHY + 1)
    assert server.client.snapshot().num_failed_steps == 1


# -- sampling (the engine's runner) -----------------------------------------------------------------
class PoisonSampler(Sampler):
    """Raises when preparing any row of a request with seed `POISON_SEED` (its parameters break it)."""

    def prepare(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[History] = (),
        *,
        greedy: torch.Tensor | None = None,
    ) -> Prepared:
        if any(p.seed == POISON_SEED for p in params):
            raise FloatingPointError("simulated sampler fault")
        return super().prepare(logits, params, histories, greedy=greedy)


@pytest.fixture(scope="module")
def engine_server() -> Iterator[RunningServer]:
    config = SchedulerConfig.from_dict({"max_model_len": 1024}, base=PRESETS["engine"])
    backend = make_backend("engine", config, BackendOptions(served_model_name=MODEL))
    runner = backend.executor.runner  # type: ignore[attr-defined]
    runner.sampler = PoisonSampler()
    server = start_server(backend=backend)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_sampling_a_sampler_that_raises_for_one_row_fails_that_request_alone(engine_server: RunningServer) -> None:
    server = engine_server
    greedy = {**HEALTHY, "temperature": 0.0}
    alone = call(server, greedy)  # the reference: the same request without the fault around it
    assert alone.status == 200 and alone.num_tokens == HEALTHY_TOKENS
    poisoned_body = {**POISONED, "temperature": 1.0, "seed": POISON_SEED}
    poisoned, healthy = poison_then_check(server, lambda: call(server, poisoned_body, stream=True), greedy)
    assert poisoned.status == 200 and poisoned.done and poisoned.error is not None
    assert "the executor failed in step" in poisoned.error["message"]
    assert "simulated sampler fault" in poisoned.error["message"]
    assert_completed(healthy, text=None)
    assert all(out.text == alone.text for out in healthy), (alone.text, [o.text for o in healthy])
    assert failed(server)["step"] == 1
    assert server.client.snapshot().num_failed_steps == 1


# -- detokenization and the stop check (the loop's output processing) -----------------------------------
class PoisonDecoder:
    """The sim's decoder, raising on a window that holds `POISON_TOKEN` (a prompt token: the
    incremental detokenizer decodes the prompt's last tokens with the new ones)."""

    def __init__(self, inner: Decoder) -> None:
        self.inner = inner

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if POISON_TOKEN in token_ids:
            raise OverflowError("simulated detokenizer fault")
        return self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_detokenization_a_decoder_that_raises_fails_its_request_alone(make_server: Any) -> None:
    backend = sim_backend(COST)
    backend.decoder = PoisonDecoder(backend.decoder)  # type: ignore[assignment]
    server: RunningServer = make_server(backend=backend)
    body = {**POISONED, "prompt": [5, POISON_TOKEN, 7]}
    poisoned, healthy = poison_then_check(server, lambda: call(server, body))
    assert poisoned.status == 500 and poisoned.error is not None
    assert "its output could not be processed: OverflowError: simulated detokenizer fault" in poisoned.error["message"]
    assert_completed(healthy)
    only_failures(server, output=1)
    assert server.client.snapshot().num_failed_steps == 0


class ExplodingChecker(StopChecker):
    def feed(self, delta: str) -> tuple[str, bool]:
        raise RuntimeError("simulated stop-check fault")


class PoisonStopStream(TextStream):
    """A text stream whose stop check raises when one of its stop strings holds POISON."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = ()) -> None:
        super().__init__(tokenizer, prompt_token_ids, stop)
        if any("POISON" in s for s in stop):
            self.checker = ExplodingChecker(stop)


def test_stop_check_a_stop_check_that_raises_fails_its_request_alone(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("contbatch.server.driver.TextStream", PoisonStopStream)  # what the driver builds
    server: RunningServer = make_server(cost=COST)
    poisoned, healthy = poison_then_check(server, lambda: call(server, {**POISONED, "stop": ["POISON"]}, stream=True))
    assert poisoned.status == 200 and poisoned.done and poisoned.error is not None
    assert "its output could not be processed: RuntimeError: simulated stop-check fault" in poisoned.error["message"]
    assert_completed(healthy)
    only_failures(server, output=1)


# -- delivery ---------------------------------------------------------------------------------------
class SinkFaultClient(DriverClient):
    """Its poisoned requests' event sink raises on their first token event (the final one gets through)."""

    def generate(self, submission: Submission) -> RequestStream:
        stream = RequestStream(submission.request_id, self)
        if submission.params.seed != POISON_SEED:
            self.driver.submit(submission, asyncio.get_running_loop(), stream.push)
            return stream

        def sink(event: RequestEvent) -> None:
            if event.token_ids and not event.is_final:
                raise ConnectionResetError("simulated sink fault")
            stream.push(event)

        self.driver.submit(submission, asyncio.get_running_loop(), sink)
        return stream


def test_delivery_a_sink_that_raises_fails_its_request_alone(make_server: Any) -> None:
    server = start_server(client=SinkFaultClient(sim_backend(COST)))
    try:
        poisoned, healthy = poison_then_check(
            server, lambda: call(server, {**POISONED, "seed": POISON_SEED, "max_tokens": 50}, stream=True)
        )
        assert poisoned.status == 200 and poisoned.done and poisoned.error is not None
        message = poisoned.error["message"]
        assert "its output could not be delivered: ConnectionResetError: simulated sink fault" in message
        assert poisoned.num_tokens < 50  # ended early, not run to its length
        assert_completed(healthy)
        only_failures(server, delivery=1)
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_delivery_a_response_that_cannot_be_rendered_fails_its_request_alone(
    make_server: Any, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The HTTP side raises rendering the poisoned (chat) request's tokens: it gets a 500 (or an
    error event, its stream started) and its request ends, counted as a delivery failure; the
    completions streams are untouched."""
    from contbatch.server.formats import Renderer

    real_render = Renderer.render

    def render(self: Renderer, event: RequestEvent) -> tuple[str, dict[str, object] | None]:
        if self.chat and event.token_ids:
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "simulated writer fault")
        return real_render(self, event)

    monkeypatch.setattr(Renderer, "render", render)
    server: RunningServer = make_server(cost=COST)
    body = {**POISONED, "prompt": None, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    poisoned, healthy = poison_then_check(server, lambda: call(server, body, chat=True, stream=stream))
    assert poisoned.error is not None and "UnicodeEncodeError" in poisoned.error["message"]
    if stream:
        assert poisoned.status == 200 and poisoned.done and "the stream failed" in poisoned.error["message"]
    else:
        assert poisoned.status == 500
    assert_completed(healthy)
    only_failures(server, delivery=1)
    assert http_errors(server) == ({} if stream else {"500": 1})


def test_delivery_a_client_that_disconnects_mid_stream_cancels_its_request_alone(make_server: Any) -> None:
    server: RunningServer = make_server(cost=COST)

    def leave_after_one_chunk() -> Outcome:
        body = {**POISONED, "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk read, then the connection is closed
        deadline = time.monotonic() + 10
        while server.client.snapshot().num_running > NUM_HEALTHY:  # cancelled at a step boundary
            assert time.monotonic() < deadline
            time.sleep(0.005)
        return Outcome(r.status_code)

    poisoned, healthy = poison_then_check(server, leave_after_one_chunk)
    assert poisoned.status == 200
    assert_completed(healthy)
    assert metrics(server)[("contbatch:request_cancelled_total", ())] == 1
    only_failures(server)
    assert success(server) == NUM_HEALTHY
