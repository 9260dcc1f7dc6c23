"""The one step loop (`contbatch.loop.EngineCore`) on its own: outputs and finishing, failure
isolation (a failing step, a failing text stream), bookkeeping reaching the executor at no time,
and the two clocks."""

from __future__ import annotations

from collections.abc import Sequence

from contbatch.core import ContinuousScheduler, FinishReason, SchedulerConfig, SchedulerOutput, StepResult
from contbatch.core.config import KVConfig
from contbatch.loop import EngineCore, Intake, SamplingParams, StepError, StepObserver, StepRecord, TextStream
from contbatch.loop.clock import VirtualClock, WallClock
from contbatch.sim import UnitCost


class Letters:
    """Decodes token id i as chr(ord('a') + i % 26); raises on `poison`."""

    def __init__(self, poison: int | None = None) -> None:
        self.poison = poison

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self.poison is not None and self.poison in token_ids:
            raise OverflowError("number too small to fit in target type")
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


class Echo:
    """Samples token (step id) for every sampling chunk; records what the outputs told it."""

    def __init__(self, fail_for: str | None = None) -> None:
        self.fail_for = fail_for
        self.outputs: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.outputs.append(out)
        if self.fail_for is not None and any(c.request_id == self.fail_for for c in out.chunks):
            raise StepError([self.fail_for], RuntimeError("device on fire"))
        return StepResult(sampled_token_ids={c.request_id: (out.step_id,) for c in out.chunks if c.samples})


def core_with(executor: Echo, **config: object) -> tuple[EngineCore, Intake]:
    scheduler = ContinuousScheduler(SchedulerConfig(kv=KVConfig(num_blocks=64, block_size=4), **config))  # type: ignore[arg-type]
    return EngineCore(scheduler, executor, VirtualClock(UnitCost(8))), Intake()


def add(
    core: EngineCore, intake: Intake, rid: str, decoder: Letters, *, max_tokens: int = 3, stop: tuple[str, ...] = ()
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop)
    request = intake.request(rid, (1, 2, 3), params, arrival_ts=core.clock.now())
    core.add_request(request, TextStream(decoder, (1, 2, 3), stop))


def run(core: EngineCore) -> dict[str, list[object]]:
    while core.has_unfinished():
        core.step()
    by_id: dict[str, list[object]] = {}
    for output in core.take_outputs():
        by_id.setdefault(output.request_id, []).append(output)
    return by_id


def test_outputs_come_queued_then_tokens_then_one_final() -> None:
    core, intake = core_with(Echo())
    add(core, intake, "a", Letters(), max_tokens=3)
    outputs = run(core)["a"]
    assert outputs[0].queued and not outputs[0].is_final  # type: ignore[attr-defined]
    assert [o.is_final for o in outputs] == [False, False, False, True]  # type: ignore[attr-defined]
    assert outputs[-1].finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]
    assert "".join(o.text for o in outputs) == "abc"  # type: ignore[attr-defined]  # token ids 0, 1, 2


def test_a_rejection_is_the_final_output_at_once() -> None:
    core, intake = core_with(Echo(), max_model_len=4)
    add(core, intake, "long", Letters(), max_tokens=8)
    (final,) = core.take_outputs()
    assert final.finish_reason is FinishReason.REJECTED and final.reject_kind == "max_model_len"
    assert not core.has_unfinished()


def test_a_stop_string_ends_the_request_with_stop_and_frees_it() -> None:
    core, intake = core_with(Echo())
    add(core, intake, "s", Letters(), max_tokens=8, stop=("bc",))
    outputs = run(core)["s"]
    assert "".join(o.text for o in outputs) == "a"  # type: ignore[attr-defined]
    assert outputs[-1].finish_reason is FinishReason.STOP  # type: ignore[attr-defined]
    assert core.scheduler.kv_usage == 0.0


def test_a_failing_text_stream_ends_that_request_alone() -> None:
    """The poison request of issue 15: its detokenizer raises; it ends with ERROR, its neighbour
    in the same steps completes."""
    core, intake = core_with(Echo())
    add(core, intake, "poison", Letters(poison=1), max_tokens=4)
    add(core, intake, "healthy", Letters(), max_tokens=4)
    outputs = run(core)
    assert outputs["poison"][-1].finish_reason is FinishReason.ERROR  # type: ignore[attr-defined]
    assert "OverflowError" in outputs["poison"][-1].finish_detail  # type: ignore[attr-defined]
    assert outputs["healthy"][-1].finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]
    assert core.totals.num_failed_steps == 0


def test_a_failing_step_ends_the_requests_it_names_and_the_loop_goes_on() -> None:
    executor = Echo(fail_for="bad")
    core, intake = core_with(executor)
    add(core, intake, "bad", Letters())
    add(core, intake, "good", Letters())
    outputs = run(core)
    assert outputs["bad"][-1].finish_reason is FinishReason.ERROR  # type: ignore[attr-defined]
    assert "device on fire" in outputs["bad"][-1].finish_detail  # type: ignore[attr-defined]
    assert outputs["good"][-1].finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]
    assert core.totals.num_failed_steps == 1


def test_bookkeeping_reaches_the_executor_at_no_time() -> None:
    """An abort while nothing runs: the next output has no chunks, only the finished id; the
    executor sees it, the virtual clock does not move, no step is counted."""
    executor = Echo()
    core, intake = core_with(executor)
    add(core, intake, "a", Letters(), max_tokens=50)
    core.step()
    steps, now = core.totals.num_steps, core.clock.now()
    core.abort("a")
    assert not core.step()
    assert executor.outputs[-1].finished_ids == ("a",) and not executor.outputs[-1].chunks
    assert core.totals.num_steps == steps and core.clock.now() == now


def test_observers_see_every_step_and_every_tracked_finish() -> None:
    class Log(StepObserver):
        def __init__(self) -> None:
            self.steps: list[StepRecord] = []
            self.finished: list[str] = []

        def on_step(self, record: StepRecord) -> None:
            self.steps.append(record)

        def on_finished(self, request: object, final: object = None) -> None:
            self.finished.append(request.request_id)  # type: ignore[attr-defined]

    log = Log()
    core, intake = core_with(Echo())
    core.observers.append(log)
    add(core, intake, "a", Letters(), max_tokens=2)
    run(core)
    assert [r.out.step_id for r in log.steps] == [0, 1] and log.finished == ["a"]
    assert all(r.end_ts > r.start_ts for r in log.steps)


def test_the_wall_clock_ends_a_step_when_its_executor_returns() -> None:
    times = iter([1.0, 3.5])
    clock = WallClock(lambda: next(times))
    assert clock.now() == 1.0 and clock.step_end(SchedulerOutput(0, (), 0, 0, 0, 0), 1.0) == 3.5
