"""Synthetic steps over a grid, timed on the real model runner.

A grid point (P, D, X) is one step of D decodes reading X positions of context on average (each
itself included), plus, when P > 0, one prefill chunk of P tokens that samples its first token; with no
decode that chunk continues a prefill started at X, otherwise it starts at 0. So the step's
`SchedulerOutput` has num_prefill_tokens == P, num_decode_tokens == D and (num_context_tokens - P)
/ max(1, D) == X: the coordinates `contbatch.sim.costs.profile` looks a table up by. A real batch holds requests at
every stage, so its decodes' contexts differ, and the runner splits decodes of very different
lengths into separate attention calls: the grid's decodes therefore spread their contexts
linearly from X / 4 to 7 X / 4 (`decode_contexts`), not all at X. The decode
count axis doubles as the batch-size bucket axis (CUDA-graph style buckets pad the batch to these
sizes; this engine executes no padding, so a bucket costs what its real decodes cost).

Every request gets its own KV blocks (no two read the same memory, as in a real batch); a point
that does not fit in the runner's cache is a `CalibrationError`. Timing is interleaved, so that a
burst of load from a neighbour on a shared machine touches one run of many points rather than
every run of a few: `repeats` passes over all the points, each pass timing every point once
(after `warmup` untimed runs in the first pass, and, for a point faster than `REWARM_BELOW_S`,
one untimed run in every later pass: in a real run a small step follows a similar one, not the
grid's previous, larger point, whose memory traffic it would otherwise pay for); from pass
`MIN_REPEATS` on, a point that has already taken `point_budget_s` is skipped. A point's time is
the median of its runs.

A run is timed by the grid's `clock` (`CLOCKS`): `wall` (the default) by elapsed time, which a
neighbour's load inflates whenever the runner's thread waits for a core; `thread-cpu` by the CPU
time of the calling thread, which such waits do not move. The second is the runner's whole time
only when the runner does all its work on that thread: one torch thread on the CPU
(`CalibrationConfig` refuses it otherwise).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from contbatch.calibrate.fit import StepSample
from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.loop.params import SamplingParams

MIN_REPEATS = 3
REWARM_BELOW_S = 0.02  # a point faster than this runs once untimed before each timed run
GREEDY = SamplingParams(temperature=0.0)
CLOCKS: Mapping[str, Callable[[], float]] = {"wall": time.perf_counter, "thread-cpu": time.thread_time}


class CalibrationError(ValueError):
    """Calibration cannot run as asked (a grid point too large for the cache, a bad grid)."""


@dataclass(frozen=True, slots=True)
class GridSpec:
    prefill: tuple[int, ...] = (0, 64, 256, 512, 1024)  # prefill tokens; must start with 0
    decode: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)  # decodes (batch buckets); from 0
    context: tuple[int, ...] = (32, 128, 384, 768)  # context per decode, >= 1
    warmup: int = 1
    repeats: int = 5
    point_budget_s: float = 0.5  # timed seconds after which a point gets no more passes (beyond MIN_REPEATS)
    clock: str = "wall"  # what times a run: a key of CLOCKS (see the module docstring)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "context"):
            axis = getattr(self, name)
            if not axis or any(b <= a for a, b in itertools.pairwise(axis)) or axis[0] < 0:
                raise CalibrationError(f"grid {name} axis must be non-empty, >= 0 and strictly increasing: {axis}")
        if self.prefill[0] != 0 or self.decode[0] != 0 or len(self.prefill) < 3:
            raise CalibrationError("the grid's prefill and decode axes must start at 0 (prefill needs 3+ values)")
        if self.context[0] < 1:
            raise CalibrationError("the grid's context axis must be >= 1")
        if self.warmup < 0 or self.repeats < MIN_REPEATS:
            raise CalibrationError(f"warm-up must be >= 0 and repeats >= {MIN_REPEATS}")
        if self.clock not in CLOCKS:
            raise CalibrationError(f"unknown clock {self.clock!r}: use one of {', '.join(CLOCKS)}")

    def points(self) -> list[tuple[int, int, int]]:
        """Every (prefill, decode, context) but the empty steps."""
        return [(p, d, c) for c in self.context for p in self.prefill for d in self.decode if p or d]


def check_fits_model(spec: GridSpec, max_model_len: int) -> None:
    """Every grid position must exist in the model: the longest decode (7 / 4 of the largest context)
    and the largest prefill continued at the largest context."""
    longest = max(spec.prefill[-1] + spec.context[-1], *decode_contexts(3, spec.context[-1]))
    if longest > max_model_len:
        raise CalibrationError(
            f"the grid reaches position {longest} but the model holds {max_model_len}: "
            "lower the largest prefill or context"
        )


def decode_contexts(num_decodes: int, mean: int) -> list[int]:
    """Contexts of a grid point's decodes: spread linearly over [mean / 4, 7 * mean / 4], summing to
    exactly num_decodes * mean (one decode: mean)."""
    if num_decodes <= 1:
        return [mean] * num_decodes
    low = max(1, mean // 4)
    high = 2 * mean - low
    contexts = [low + round((high - low) * i / (num_decodes - 1)) for i in range(num_decodes)]
    contexts[-1] += num_decodes * mean - sum(contexts)  # rounding: keep the mean exact
    return contexts


def blocks_needed(point: tuple[int, int, int], block_size: int) -> int:
    """KV blocks the step of a grid point holds (each request its own)."""
    prefill, decode, context = point
    prefill_length = prefill + (0 if decode else context) if prefill else 0
    decode_blocks = sum(-(-length // block_size) for length in decode_contexts(decode, context))
    return decode_blocks + -(-prefill_length // block_size)


def synthetic_step(
    point: tuple[int, int, int], *, block_size: int, num_blocks: int, vocab: int, seed: int = 0
) -> tuple[SchedulerOutput, dict[str, SequenceState]]:
    """The step of a grid point (see the module docstring), with its sequences and block tables."""
    prefill, decode, context = point
    if blocks_needed(point, block_size) > num_blocks:
        raise CalibrationError(
            f"grid point (prefill {prefill}, decode {decode}, context {context}) needs "
            f"{blocks_needed(point, block_size)} KV blocks, the cache has {num_blocks}: shrink the grid"
        )
    rng = random.Random(seed)
    pattern = [rng.randrange(3, vocab) for _ in range(block_size)]  # token values do not change the time
    next_block = 0
    chunks: list[ScheduledChunk] = []
    seqs: dict[str, SequenceState] = {}

    def add(rid: str, length: int, start: int, new: int, is_prefill: bool) -> None:
        nonlocal next_block
        blocks = -(-length // block_size)
        tokens = (pattern * (blocks + 1))[:length]
        seqs[rid] = SequenceState(tokens, range(next_block, next_block + blocks), GREEDY)
        chunks.append(ScheduledChunk(rid, start, new, is_prefill, True))
        next_block += blocks

    for i, length in enumerate(decode_contexts(decode, context)):
        add(f"decode-{i}", length, length - 1, 1, False)
    if prefill:
        start = 0 if decode else context
        add("prefill", start + prefill, start, prefill, True)
    return build_output(0, chunks), seqs


def time_points(
    runner: ModelRunner,
    points: Sequence[tuple[int, int, int]],
    spec: GridSpec,
    *,
    on_run: Callable[[], None] | None = None,
) -> list[StepSample]:
    """One `StepSample` per point, timed on `runner` in interleaved passes (see the module docstring)."""
    times: list[list[float]] = [[] for _ in points]
    clock = CLOCKS[spec.clock]
    for pass_index in range(spec.repeats):
        for index, point in enumerate(points):
            if pass_index >= MIN_REPEATS and sum(times[index]) > spec.point_budget_s:
                continue
            out, seqs = _step_on(runner, point, seed=index)
            rewarm = bool(times[index]) and min(times[index]) < REWARM_BELOW_S
            for _ in range(spec.warmup if pass_index == 0 else int(rewarm)):
                runner.execute(out, seqs)
            start = clock()
            runner.execute(out, seqs)
            times[index].append(clock() - start)
            if on_run is not None:
                on_run()
    samples = []
    for point, found in zip(points, times, strict=True):
        out, _ = _step_on(runner, point, seed=0)
        ms = 1000.0 * statistics.median(found)
        samples.append(
            StepSample(out.num_prefill_tokens, out.num_decode_tokens, out.num_context_tokens, out.num_requests, ms)
        )
    return samples


def _step_on(
    runner: ModelRunner, point: tuple[int, int, int], seed: int
) -> tuple[SchedulerOutput, dict[str, SequenceState]]:
    cache = runner.kv_cache
    return synthetic_step(
        point, block_size=cache.block_size, num_blocks=cache.num_blocks, vocab=runner.spec.vocab_size, seed=seed
    )


def heldout_points(spec: GridSpec, count: int, *, seed: int = 1) -> list[tuple[int, int, int]]:
    """`count` points drawn uniformly inside the grid's ranges, off its values where possible."""
    rng = random.Random(seed)
    points: list[tuple[int, int, int]] = []
    while len(points) < count:
        point = (
            _off_grid(rng, spec.prefill),
            _off_grid(rng, spec.decode),
            _off_grid(rng, spec.context),
        )
        if point[0] or point[1]:
            points.append(point)
    return points


def _off_grid(rng: random.Random, axis: tuple[int, ...]) -> int:
    """A value between two neighbouring axis values (or an axis value when they are adjacent)."""
    i = rng.randrange(len(axis) - 1) if len(axis) > 1 else 0
    low, high = axis[i], axis[min(i + 1, len(axis) - 1)]
    return rng.randint(low + 1, high - 1) if high - low >= 2 else low
