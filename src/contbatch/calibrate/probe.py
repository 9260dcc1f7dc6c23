"""The machine's speed now, against the speed it had when a profile was calibrated.

A profile prices steps at the speed the machine had during the calibration engine runs (the loop
scales tie the grid to those runs). A shared or virtual machine does not keep one speed: from one
minute to the next its steps take a few percent more or less time (frequency, neighbours' memory
traffic, host scheduling), and near capacity queueing turns a few percent per step into ten
percent on TPOT and E2E. So the calibration stores a *probe*: a few fixed synthetic steps
(`probe_points`, shaped like a mid-sized continuous batch, fitted to the model's length) timed
on the runner before, between and after its engine runs (their geometric mean is the reference).
`speed_factor(now, then)` is the geometric mean over the points of now / then: a validation
times the profile's probe points around each engine replay and prices the simulator at that
speed (`ProfileCost.at_speed`). The probe reads no part of the trace it is used with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from contbatch.calibrate.grid import CalibrationError, GridSpec, decode_contexts, time_points
from contbatch.engine.runner import ModelRunner

PROBE_DECODES = (4, 12, 24)  # decode-only batches of three sizes, and a prefill chunk mixed into 8 decodes
PROBE_CONTEXT = 256  # context per decode (less on a model that does not hold 7 / 4 of it)
PROBE_PREFILL = 256  # tokens of the mixed step's prefill chunk (at most half the model's length)
PROBE_SPEC = GridSpec(warmup=2, repeats=25, point_budget_s=2.5)

Point = tuple[int, int, int]  # (prefill tokens, decodes, context per decode), as in `contbatch.calibrate.grid`


def probe_points(max_model_len: int) -> tuple[Point, ...]:
    """The probe's steps on a model of `max_model_len` positions: every position they touch exists
    (the grid spreads decode contexts up to 7 / 4 of the mean: `decode_contexts`)."""
    context = max(1, min(PROBE_CONTEXT, (4 * (max_model_len - 1)) // 7))
    prefill = max(1, min(PROBE_PREFILL, max_model_len // 2))
    return (*((0, decodes, context) for decodes in PROBE_DECODES), (prefill, 8, context))


def probe_key(point: Sequence[int]) -> str:
    """A point as a JSON object key: ``"prefill,decode,context"``."""
    return ",".join(str(v) for v in point)


def key_point(key: str) -> Point:
    """The point of a `probe_key`; a ValueError for anything else."""
    parts = key.split(",")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"profile field 'speed_probe.ms': {key!r} is not a probe point 'prefill,decode,context'")
    prefill, decode, context = (int(part) for part in parts)
    return prefill, decode, context


def points_of(probe: Mapping[str, float]) -> list[Point]:
    """The points a probe timed (its keys), to time them again."""
    return [key_point(key) for key in probe]


def time_probe(runner: ModelRunner, points: Sequence[Point], spec: GridSpec = PROBE_SPEC) -> dict[str, float]:
    """Median milliseconds of each point on `runner` (its KV cache is used as scratch): a
    `CalibrationError` when a point does not fit the runner's model or cache."""
    limit = runner.spec.max_model_len
    for point in points:
        prefill, decode, context = point
        longest = max([prefill + (0 if decode else context), *decode_contexts(decode, context)])
        if longest > limit:
            raise CalibrationError(
                f"speed probe point {probe_key(point)} reaches position {longest}, the model holds {limit}: "
                "was the profile calibrated on another model?"
            )
    samples = time_points(runner, points, spec)
    return {probe_key(point): sample.ms for point, sample in zip(points, samples, strict=True)}


def mean_probe(*probes: Mapping[str, float]) -> dict[str, float]:
    """Point by point geometric mean of several probes (timed before and after a run)."""
    keys = probes[0].keys()
    return {k: math.exp(sum(math.log(p[k]) for p in probes) / len(probes)) for k in keys}


def speed_factor(now: Mapping[str, float], then: Mapping[str, float]) -> float:
    """How much slower the machine runs now than then: the geometric mean of now / then over the
    points of `then` (times > 0; `now` must have timed every one of them)."""
    missing = [k for k in then if k not in now]
    if missing or not then:
        raise ValueError(f"the probes timed different points: {sorted(then)} against {sorted(now)}")
    return math.exp(sum(math.log(now[k] / then[k]) for k in then) / len(then))


def reference_probe(document: Mapping[str, object]) -> dict[str, float] | None:
    """The speed probe a profile document recorded at calibration (``speed_probe.ms``), or None
    for a profile written before probes existed. A malformed one is a ValueError naming the field."""
    record = document.get("speed_probe")
    if record is None:
        return None
    ms = record.get("ms") if isinstance(record, Mapping) else None
    if not isinstance(ms, Mapping) or not ms or not all(_positive(v) for v in ms.values()):
        raise ValueError("profile field 'speed_probe.ms' must map probe points to times > 0 (ms)")
    return {probe_key(key_point(str(k))): float(v) for k, v in ms.items()}


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
