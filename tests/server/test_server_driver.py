"""The step driver on its own (no HTTP): events, rejections, failure isolation, stop strings,
cancellation, output credits, timers, gathering a burst after an idle spell, and shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from contbatch.core import SchedulerConfig, check_invariants
from contbatch.core.config import PRESETS
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.core.status import FinishReason
from contbatch.server.driver import NO_GATHER, Driver, DriverClosed, Gather
from contbatch.server.types import RequestEvent, SamplingParams, Submission


class FakeExecutor:
    """One token per sampling chunk; optionally slow or failing. Records what the step outputs
    told it: the requests it was asked to start and those it was told had finished."""

    def __init__(self, *, step_s: float = 0.0, fail_when: Callable[[SchedulerOutput], bool] | None = None) -> None:
        self.step_s = step_s
        self.fail_when = fail_when
        self.added: list[str] = []
        self.released: list[str] = []
        self.steps: list[list[str]] = []  # the requests of each step's chunks
        self.num_steps = 0

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.steps.append([c.request_id for c in out.chunks])
        self.added += [new.request_id for new in out.new_requests]
        self.released += out.finished_ids
        if not out.chunks:
            return StepResult()
        self.num_steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        if self.fail_when is not None and self.fail_when(out):
            raise RuntimeError("device on fire")
        return StepResult(sampled_token_ids={c.request_id: (7,) for c in out.chunks if c.samples})


@dataclass
class Words:
    word: str

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.word * len(token_ids)


@dataclass
class FakeBackend:
    executor: FakeExecutor
    config: SchedulerConfig
    decoder: Words
    name: str = "fake"
    model_name: str = "fake"
    vocab_size: int | None = None

    def tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(range(len(text.split())))

    def chat_prompt_ids(self, messages: Sequence[Any]) -> tuple[int, ...]:
        return ()

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_driver(executor: FakeExecutor, *, word: str = "ab", gather: Gather = NO_GATHER, **overrides: Any) -> Driver:
    config = SchedulerConfig.from_dict(overrides, base=PRESETS["engine"])
    return Driver(FakeBackend(executor, config, Words(word)), gather=gather)


def sub(rid: str, *, prompt: int = 8, max_tokens: int = 4, stop: tuple[str, ...] = (), at: float = 0.0) -> Submission:
    return Submission(rid, (1,) * prompt, SamplingParams(max_tokens=max_tokens, stop=stop), at or time.monotonic())


class Collector:
    """Submits on the running loop and gathers each request's events."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.queues: dict[str, asyncio.Queue[RequestEvent]] = {}

    def submit(self, submission: Submission) -> None:
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.queues[submission.request_id] = queue
        self.driver.submit(submission, asyncio.get_running_loop(), queue.put_nowait)

    async def until_final(self, rid: str, timeout: float = 5.0) -> list[RequestEvent]:
        events: list[RequestEvent] = []
        async with asyncio.timeout(timeout):
            while not events or not events[-1].is_final:
                events.append(await self.queues[rid].get())
        return events


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_clean(driver: Driver) -> None:
    scheduler = driver.scheduler
    check_invariants(scheduler)
    assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
    assert scheduler.kv_usage == 0.0


def test_events_come_in_order_and_end_once() -> None:
    executor = FakeExecutor()
    driver = make_driver(executor)
    driver.start()

    async def main() -> list[RequestEvent]:
        c = Collector(driver)
        c.submit(sub("a", max_tokens=5))
        return await c.until_final("a")

    events = run(main())
    driver.stop()
    assert events[0].queued and not events[0].is_final
    tokens = events[1:]
    assert [e.num_output_tokens for e in tokens] == [1, 2, 3, 4, 5]
    assert tokens[-1].finish_reason is FinishReason.LENGTH
    assert "".join(e.text for e in tokens) == "ab" * 5
    assert executor.added == ["a"] and not driver.core.tracked_ids()
    assert_clean(driver)


def test_rejections_name_their_kind() -> None:
    driver = make_driver(FakeExecutor(), max_model_len=10, max_num_seqs=1, lifecycle={"max_waiting": 2})

    async def main() -> dict[str, RequestEvent]:
        c = Collector(driver)
        c.submit(sub("too-long", prompt=8, max_tokens=5))
        for rid in ("r1", "r2", "r3", "r4"):
            c.submit(sub(rid, prompt=2, max_tokens=2))
        driver.start()  # all four are applied in one inbox drain
        return {rid: (await c.until_final(rid))[-1] for rid in c.queues}

    finals = run(main())
    driver.stop()
    assert finals["too-long"].finish_reason is FinishReason.REJECTED
    assert finals["too-long"].reject_kind == "max_model_len"
    assert finals["r1"].finish_reason is FinishReason.LENGTH
    # r1 takes the free seat, r2 and r3 fill the waiting queue
    assert finals["r2"].finish_reason is finals["r3"].finish_reason is FinishReason.LENGTH
    assert finals["r4"].reject_kind == "queue_full"


def test_duplicate_request_ids_are_refused() -> None:
    driver = make_driver(FakeExecutor(step_s=0.01))
    driver.start()

    async def main() -> tuple[RequestEvent, RequestEvent]:
        c = Collector(driver)
        c.submit(sub("same", max_tokens=20))
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        driver.submit(sub("same"), asyncio.get_running_loop(), queue.put_nowait)
        second = await queue.get()
        first = (await c.until_final("same"))[-1]
        return first, second

    first, second = run(main())
    driver.stop()
    assert first.finish_reason is FinishReason.LENGTH
    assert second.finish_reason is FinishReason.REJECTED and second.reject_kind == "duplicate_id"


def test_a_failing_step_fails_only_its_requests_and_the_loop_keeps_serving() -> None:
    executor = FakeExecutor(fail_when=lambda out: any(c.request_id == "bad" for c in out.chunks))
    driver = make_driver(executor)
    driver.start()

    async def main() -> dict[str, RequestEvent]:
        c = Collector(driver)
        c.submit(sub("before", max_tokens=3))
        finals = {"before": (await c.until_final("before"))[-1]}
        c.submit(sub("bad"))
        finals["bad"] = (await c.until_final("bad"))[-1]
        c.submit(sub("after", max_tokens=3))
        finals["after"] = (await c.until_final("after"))[-1]
        return finals

    finals = run(main())
    driver.stop()
    assert finals["before"].finish_reason is FinishReason.LENGTH
    assert finals["bad"].finish_reason is FinishReason.ERROR
    assert "device on fire" in finals["bad"].finish_detail
    assert finals["after"].finish_reason is FinishReason.LENGTH
    assert driver.snapshot.num_failed_steps == 1
    assert executor.added == ["before", "bad", "after"] and {"before", "bad"} <= set(executor.released)
    assert_clean(driver)


def test_requests_sharing_the_failed_step_fail_with_it() -> None:
    executor = FakeExecutor(fail_when=lambda out: any(c.request_id == "bad" for c in out.chunks))
    driver = make_driver(executor)

    async def main() -> dict[str, RequestEvent]:
        c = Collector(driver)
        c.submit(sub("bad"))
        c.submit(sub("neighbour"))
        driver.start()
        return {rid: (await c.until_final(rid))[-1] for rid in ("bad", "neighbour")}

    finals = run(main())
    driver.stop()
    assert {e.finish_reason for e in finals.values()} == {FinishReason.ERROR}
    assert_clean(driver)


def test_stop_strings_cut_the_text_and_finish_with_stop() -> None:
    driver = make_driver(FakeExecutor(), word="ab")
    driver.start()

    async def main() -> list[RequestEvent]:
        c = Collector(driver)
        c.submit(sub("s", max_tokens=10, stop=("ba",)))
        return await c.until_final("s")

    events = run(main())
    driver.stop()
    assert "".join(e.text for e in events) == "a"  # "ab" + "ab" = "abab": stops before "ba"
    assert events[-1].finish_reason is FinishReason.STOP
    assert events[-1].num_output_tokens == 2
    assert_clean(driver)


def test_abort_cancels_at_the_next_step_and_frees_everything() -> None:
    executor = FakeExecutor(step_s=0.005)
    driver = make_driver(executor)
    driver.start()

    async def main() -> list[RequestEvent]:
        c = Collector(driver)
        c.submit(sub("long", max_tokens=10_000))
        events = [await c.queues["long"].get(), await c.queues["long"].get()]  # queued, first tokens
        driver.abort("long")
        return events + await c.until_final("long")

    events = run(main())
    steps_at_abort = executor.num_steps
    driver.stop()
    final = events[-1]
    assert final.finish_reason is FinishReason.CANCELLED
    assert final.num_output_tokens < 10_000
    assert executor.num_steps <= steps_at_abort + 1
    assert_clean(driver)


def test_a_client_that_does_not_ack_is_paused_at_its_credits() -> None:
    driver = make_driver(FakeExecutor(step_s=0.001), lifecycle={"output_credits": 3})
    driver.start()

    async def main() -> tuple[int, int, RequestEvent]:
        c = Collector(driver)
        c.submit(sub("slow", max_tokens=10))
        await asyncio.sleep(0.2)  # many steps' worth: only the credits' worth may be generated
        generated = driver.scheduler.requests["slow"].num_output_tokens
        paused = driver.snapshot.num_paused
        received = 0
        while True:
            event = await c.queues["slow"].get()
            driver.ack("slow", len(event.token_ids))
            received += len(event.token_ids)
            if event.is_final:
                return generated, paused, event

    generated, paused, final = run(main())
    driver.stop()
    assert generated == 3 and paused == 1
    assert final.finish_reason is FinishReason.LENGTH and final.num_output_tokens == 10
    assert_clean(driver)


def test_an_idle_driver_wakes_for_a_timeout() -> None:
    # "held" takes the only slot and stalls (no acks); "queued" can only time out, while nothing runs
    driver = make_driver(FakeExecutor(), max_num_seqs=1, lifecycle={"output_credits": 1, "ttft_timeout": 0.2})
    driver.start()

    async def main() -> RequestEvent:
        c = Collector(driver)
        c.submit(sub("held", max_tokens=5))
        await c.queues["held"].get()
        c.submit(sub("queued"))
        # nothing else happens: only the driver's own timer can end "queued" before this bound
        return (await c.until_final("queued", timeout=60.0))[-1]

    final = run(main())
    driver.stop()
    assert final.finish_reason is FinishReason.TIMEOUT and "ttft_timeout" in final.finish_detail


def test_stop_lets_short_requests_finish_cancels_long_ones_and_refuses_new_ones() -> None:
    driver = make_driver(FakeExecutor(step_s=0.01))
    driver.start()
    finals: dict[str, RequestEvent] = {}

    async def main() -> None:
        c = Collector(driver)
        c.submit(sub("short", max_tokens=5))
        c.submit(sub("long", max_tokens=50_000))
        await c.queues["short"].get()
        stopping = asyncio.ensure_future(asyncio.to_thread(driver.stop, 0.3))
        for rid in ("short", "long"):
            finals[rid] = (await c.until_final(rid))[-1]
        await stopping
        with pytest.raises(DriverClosed):
            driver.submit(sub("late"), asyncio.get_running_loop(), lambda e: None)

    run(main())
    assert finals["short"].finish_reason is FinishReason.LENGTH
    assert finals["long"].finish_reason is FinishReason.CANCELLED
    assert "shut down" in finals["long"].finish_detail
    assert not driver.is_alive
    assert_clean(driver)


def test_a_broken_sink_does_not_stop_the_driver() -> None:
    driver = make_driver(FakeExecutor())
    driver.start()

    def broken(event: RequestEvent) -> None:
        raise ValueError("sink bug")

    async def main() -> RequestEvent:
        driver.submit(sub("x"), asyncio.get_running_loop(), broken)
        c = Collector(driver)
        c.submit(sub("y"))
        return (await c.until_final("y"))[-1]

    final = run(main())
    driver.stop()
    assert final.finish_reason is FinishReason.LENGTH
    assert_clean(driver)


def test_an_idle_driver_gathers_a_burst_into_its_first_step() -> None:
    # gap 1 s: submissions 50 ms apart all join the first step, which takes the shortest first
    executor = FakeExecutor()
    driver = make_driver(executor, gather=Gather(gap_s=1.0, max_s=30.0), queue_order="shortest")
    driver.start()

    async def main() -> None:
        c = Collector(driver)
        for rid, prompt in (("long", 12), ("mid", 8), ("short", 4)):
            c.submit(sub(rid, prompt=prompt, max_tokens=2))
            await asyncio.sleep(0.05)
        for rid in ("long", "mid", "short"):
            assert (await c.until_final(rid))[-1].finish_reason is FinishReason.LENGTH

    run(main())
    driver.stop()
    assert executor.steps[0] == ["short", "mid", "long"]
    assert_clean(driver)


def test_gathering_waits_while_the_http_side_is_reading() -> None:
    """A burst whose later requests are still being read (their connections opening, their
    bodies arriving: `Gather.last_activity` recent) is not over when its first submission has
    waited `gap_s`: "short", submitted after several gaps of HTTP activity, joins the first step
    and goes first; once the activity stops, the gather ends a gap later."""
    reading = threading.Event()
    reading.set()
    executor = FakeExecutor()
    gather = Gather(gap_s=0.05, max_s=30.0, last_activity=lambda: time.monotonic() if reading.is_set() else 0.0)
    driver = make_driver(executor, gather=gather, queue_order="shortest")
    driver.start()

    async def main() -> None:
        c = Collector(driver)
        c.submit(sub("long", prompt=12, max_tokens=2))
        await asyncio.sleep(0.3)  # six gaps: without the activity, "long" would have run alone
        c.submit(sub("short", prompt=4, max_tokens=2))
        reading.clear()
        for rid in ("long", "short"):
            assert (await c.until_final(rid))[-1].finish_reason is FinishReason.LENGTH

    run(main())
    driver.stop()
    assert executor.steps[0] == ["short", "long"]
    assert_clean(driver)


def test_gathering_ends_at_its_bound() -> None:
    # a gap of 60 s would hold the first step for a minute; max_s 0.05 lets it run (until_final's
    # 5 s timeout is the check)
    driver = make_driver(FakeExecutor(), gather=Gather(gap_s=60.0, max_s=0.05))
    driver.start()

    async def main() -> None:
        c = Collector(driver)
        c.submit(sub("only", max_tokens=2))
        assert (await c.until_final("only"))[-1].finish_reason is FinishReason.LENGTH

    run(main())
    driver.stop()
    assert_clean(driver)


def test_a_busy_driver_does_not_gather() -> None:
    # submissions 50 ms apart while a request runs: were the busy driver gathering (gap 60 s), no
    # step would run until they stopped; it keeps stepping, and each one joins a step
    executor = FakeExecutor(step_s=0.005)
    driver = make_driver(executor, gather=Gather(gap_s=60.0, max_s=0.01))
    driver.start()

    async def main() -> tuple[int, int]:
        c = Collector(driver)
        c.submit(sub("first", max_tokens=100_000))
        while not executor.steps:
            await asyncio.sleep(0.005)
        steps_before = len(executor.steps)
        for i in range(10):
            c.submit(sub(f"r{i}", max_tokens=1))
            await asyncio.sleep(0.05)
        steps_during = len(executor.steps) - steps_before
        for i in range(10):
            assert (await c.until_final(f"r{i}"))[-1].finish_reason is FinishReason.LENGTH
        driver.abort("first")
        await c.until_final("first")
        return steps_before, steps_during

    _, steps_during = run(main())
    driver.stop()
    assert steps_during >= 1
    assert_clean(driver)


@pytest.mark.parametrize("bad", [{"gap_s": -0.1}, {"max_s": float("inf")}, {"gap_s": float("nan")}, {"max_s": True}])
def test_gather_refuses_a_bad_number(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be a number >= 0"):
        Gather(**bad)
