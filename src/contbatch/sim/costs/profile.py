"""The profile cost model: step times fitted to the real engine by `contbatch calibrate`.

A profile (JSON, written by `contbatch.calibrate`) prices one step as::

    ms = speed * (scale * compute(out) + loop_base_ms + loop_request_ms * num_requests)
    speed = prefill_speed if the step has prefill tokens (and one is set), else speed
    scale = prefill_loop_scale if the step has prefill tokens (and the profile has one),
            else the decode_loop_scales bin of its decode count (if the profile has them),
            else loop_scale

- ``compute``: the runner's forward and sampling time, fitted on a grid of synthetic steps, either
  an `AffineCost` (base + per prefill, decode and context token) or a `TableCost` grid over
  (prefill tokens, decode tokens, context per decode), interpolated linearly along all three
  (`table_ms`; `TableCost` alone takes the nearest context). For the table, the third coordinate
  is ``(num_context_tokens - num_prefill_tokens) / max(1, num_decode_tokens)``: the mean context
  of a decode (or, with no decode, where a continued prefill chunk starts). Padding is priced as
  prefill work and swaps per block, as in those two models;
- ``loop_scale``: the runner's time inside a real engine run over the time the fit predicts for
  the same step shape (a real batch's block tables are scattered, its contexts varied, its caches
  disturbed by the loop between steps), their total time over its prediction in a real engine run;
  ``prefill_loop_scale`` the same over its steps with prefill tokens, and ``decode_loop_scales``
  over its decode-only steps per batch-size bin, ``[[lowest decode count, scale], ...]`` (the
  ratio moves with the batch: a grid step's decodes are spread wider than a real batch's);
  a decode count takes the bin at or below it (``loop_scale`` below every bin);
- ``loop_base_ms`` and ``loop_request_ms``: what the engine loop adds around the runner
  (schedule, update, detokenisation, taking in arrivals, Python), fitted on the same steps. They
  may be negative (a fit); a step never costs less than `MIN_STEP_MS`;
- ``speed``: how much slower the machine runs than during calibration (1.0 in the file; 1.03: 3 %
  slower, 0.5: twice as fast); ``prefill_speed`` the same for steps with prefill tokens alone
  (their speed moves apart from decode-only steps': prefill is compute-bound, a decode step
  memory-bound). `contbatch validate` sets both per replay (`contbatch.calibrate.validate`); the
  spec parameters ``speed=`` and ``prefill_speed=`` set them by hand.

File format (only the ``cost`` object is read here; the rest is provenance for reports)::

    {"format": "contbatch-profile", "version": 1,
     "cost": {"model": "affine" | "table", "loop_scale": 1.05, "prefill_loop_scale": 0.98,
              "decode_loop_scales": [[1, 0.95], [4, 1.0], [8, 1.06]],
              "loop_base_ms": 0.2, "loop_request_ms": 0.01,
              "swap_ms_per_block": 0.32,
              "affine": {"base_ms": 5.0, "prefill_ms": 0.25, "decode_ms": 0.6, "context_ms": 0.004,
                         "prefill_pair_ms": 0.0, "batch_pair_ms": 0.0},   # the last two optional
              "table": {"prefill_axis": [...], "decode_axis": [...], "context_axis": [...],
                        "step_ms": [...]}},   # TableCost's layout: (c * P + p) * D + d -> ms
     ...}

Both fits are stored; ``model`` names the one calibration chose (``profile:PATH,model=table``
overrides it). Errors are `CostSpecError` naming the file and the field. Spec:
``profile:PATH[,model=affine|table][,speed=F][,prefill_speed=F]``.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from contbatch.core.outputs import SchedulerOutput
from contbatch.sim.cost import AffineCost, CostModel
from contbatch.sim.costs.errors import CostSpecError, float_param, split_params, split_path
from contbatch.sim.costs.table import TableCost

PROFILE_FORMAT = "contbatch-profile"
PROFILE_VERSION = 1
PROFILE_MODELS = ("affine", "table")
PROFILE_PARAMS = ("model", "speed", "prefill_speed")
AFFINE_FIELDS = ("base_ms", "prefill_ms", "decode_ms", "context_ms")
AFFINE_OPTIONAL = ("prefill_pair_ms", "batch_pair_ms")  # 0 when absent (profiles written before the terms)
TABLE_AXES = ("prefill_axis", "decode_axis", "context_axis")
MIN_STEP_MS = 0.001  # the floor of a step's price: a step always moves the clock forward


Speed = tuple[float, float]  # step times now over at calibration: (decode-only steps, steps with prefill)
Totals = tuple[tuple[float, float], tuple[float, float]]  # (measured ms, priced ms): decode-only steps, with prefill


def kind_totals(steps: Iterable[tuple[float, SchedulerOutput]], cost: CostModel) -> Totals:
    """Measured steps, each (ms, what ran), against `cost`: (measured ms, `cost`'s price in ms)
    summed over the decode-only steps and over those with prefill tokens (`whole_speed` and
    `speeds_by_kind` turn them into the machine's speed). An engine's own steps
    (`contbatch.calibrate.validate`) and a server's steps read from outside (`contbatch.observe.steps`)
    both come here."""
    totals = [[0.0, 0.0], [0.0, 0.0]]
    for ms, out in steps:
        kind = totals[1 if out.num_prefill_tokens else 0]
        kind[0] += ms
        kind[1] += 1000.0 * cost.step_time(out)
    (dm, dp), (pm, pp) = totals
    return (dm, dp), (pm, pp)


def _ratio(measured: float, priced: float, default: float) -> float:
    return measured / priced if priced > 0 else default


def whole_speed(totals: Totals) -> float:
    """The machine's speed during a run against a profile: all its steps' measured time over
    their price (1.0 without steps)."""
    (dm, dp), (pm, pp) = totals
    return _ratio(dm + pm, dp + pp, 1.0)


def speeds_by_kind(totals: Totals) -> Speed:
    """`whole_speed` of the decode-only steps and of the steps with prefill apart; a kind the
    run has no step of takes the speed of all its steps."""
    whole = whole_speed(totals)
    return _ratio(*totals[0], whole), _ratio(*totals[1], whole)


@dataclass(frozen=True, slots=True)
class ProfileCost:
    compute: AffineCost | TableCost  # the runner's time per step (forward + sampling), seconds
    loop_scale: float = 1.0  # the runner's time in a real engine run over `compute`'s; finite, > 0
    prefill_loop_scale: float | None = None  # the same for steps with prefill tokens; None: loop_scale
    # decode-only steps by decode count: (lowest count of the bin, scale), counts increasing; (): loop_scale
    decode_loop_scales: tuple[tuple[int, float], ...] = ()
    loop_base_ms: float = 0.0  # per step, added by the engine loop around the runner; finite, may be < 0
    loop_request_ms: float = 0.0  # per scheduled request; finite, may be < 0
    source: str = "<profile>"  # the file it came from, for reports
    speed: float = 1.0  # step times now over step times at calibration; finite, > 0
    prefill_speed: float | None = None  # the same for steps with prefill tokens; None: speed

    def __post_init__(self) -> None:
        """The one check of the loop terms, for a profile file and a direct construction alike: an
        error names `source` and the field (``cost.NAME`` as in the file; the speeds are no fields)."""
        for name in ("loop_scale", "loop_base_ms", "loop_request_ms", "speed"):
            value = getattr(self, name)
            if not _is_number(value):
                raise _error(self.source, _field(name), f"must be a finite number, got {value!r}")
        for name in ("loop_scale", "speed"):
            if getattr(self, name) <= 0:
                raise _error(self.source, _field(name), f"must be > 0, got {getattr(self, name)!r}")
        for name in ("prefill_loop_scale", "prefill_speed"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                raise _error(self.source, _field(name), f"must be a finite number > 0, got {value!r}")
        bins = self.decode_loop_scales
        if any(high <= low for (low, _), (high, _) in itertools.pairwise(bins)) or any(
            not (_is_number(scale) and scale > 0) for _, scale in bins
        ):
            raise _error(
                self.source, _field("decode_loop_scales"), f"need increasing decode counts and scales > 0, got {bins!r}"
            )

    @property
    def time_unit(self) -> str:
        return "s"

    @property
    def model(self) -> str:
        """``affine`` or ``table``: which fit prices the runner."""
        return "table" if isinstance(self.compute, TableCost) else "affine"

    def step_time(self, out: SchedulerOutput) -> float:
        ms = (
            self.loop_scale_of(out) * self.compute_ms(out) + self.loop_base_ms + self.loop_request_ms * out.num_requests
        )
        speed = self.speed if self.prefill_speed is None or not out.num_prefill_tokens else self.prefill_speed
        return max(speed * ms, MIN_STEP_MS) / 1000.0

    def loop_scale_of(self, out: SchedulerOutput) -> float:
        """The in-loop scale of the runner's time for this step (module docstring)."""
        if out.num_prefill_tokens:
            return self.loop_scale if self.prefill_loop_scale is None else self.prefill_loop_scale
        bins = self.decode_loop_scales
        if not bins:
            return self.loop_scale
        index = bisect.bisect_right(bins, out.num_decode_tokens, key=lambda b: b[0]) - 1
        return self.loop_scale if index < 0 else bins[index][1]

    def at_speed(self, speed: float, prefill_speed: float | None = None) -> ProfileCost:
        """This profile on a machine whose steps take `speed` times as long as at calibration
        (steps with prefill tokens `prefill_speed` times, when given)."""
        return dataclasses.replace(self, speed=speed, prefill_speed=prefill_speed)

    def compute_ms(self, out: SchedulerOutput) -> float:
        """The runner's part of a step, in ms (swaps included)."""
        compute = self.compute
        if isinstance(compute, AffineCost):
            return compute.step_time(out) * 1000.0
        prefill = out.num_prefill_tokens + out.num_padding_tokens
        context = context_per_decode(out.num_prefill_tokens, out.num_decode_tokens, out.num_context_tokens)
        ms = table_ms(compute, prefill, out.num_decode_tokens, context)
        return ms + compute.swap_ms_per_block * out.num_swapped_blocks


def table_ms(table: TableCost, prefill: float, decode: float, context: float) -> float:
    """Trilinear interpolation: `TableCost.lookup_ms` (bilinear in prefill and decode) at the two
    context slices around `context`, then linear between them; clamped to the axes' ends."""
    axis = table.context_axis
    i = bisect.bisect_right(axis, context) - 1
    if i < 0 or i >= len(axis) - 1:
        return table.lookup_ms(prefill, decode, axis[0] if i < 0 else axis[-1])
    low, high = axis[i], axis[i + 1]
    weight = (context - low) / (high - low)
    return (1.0 - weight) * table.lookup_ms(prefill, decode, low) + weight * table.lookup_ms(prefill, decode, high)


def context_per_decode(num_prefill_tokens: int, num_decode_tokens: int, num_context_tokens: int) -> float:
    """The table's third coordinate: context beyond the prefill tokens, per decode (at least one)."""
    return (num_context_tokens - num_prefill_tokens) / max(1, num_decode_tokens)


# -- loading ---------------------------------------------------------------------------------------
def load_profile(path: str | os.PathLike[str], *, model: str | None = None) -> ProfileCost:
    """Read a profile JSON file; `model` overrides the fit it chose. CostSpecError names file and field."""
    label = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except FileNotFoundError:
        raise CostSpecError(f"{label}: no such profile file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CostSpecError(f"{label}: not a JSON profile ({_one_line(exc)})") from None
    except OSError as exc:
        raise CostSpecError(f"{label}: cannot read: {exc.strerror or exc}") from None
    return profile_from_document(document, label, model=model)


def profile_from_document(document: object, label: str = "<profile>", *, model: str | None = None) -> ProfileCost:
    """The `ProfileCost` of a parsed profile document (format in the module docstring)."""
    root = _mapping(document, label, "")
    if root.get("format") != PROFILE_FORMAT:
        raise _error(label, "format", f"must be {PROFILE_FORMAT!r}, got {root.get('format')!r}")
    if root.get("version") != PROFILE_VERSION:
        raise _error(label, "version", f"must be {PROFILE_VERSION}, got {root.get('version')!r}")
    cost = _mapping(root.get("cost"), label, "cost")
    chosen = model if model is not None else cost.get("model")
    if chosen not in PROFILE_MODELS:
        field = "model parameter" if model is not None else "cost.model"
        raise _error(label, field, f"must be one of {', '.join(PROFILE_MODELS)}, got {chosen!r}")
    swap = _number(cost, "swap_ms_per_block", label, "cost", minimum=0.0)
    if chosen == "affine":
        compute: AffineCost | TableCost = _affine(cost, label, swap)
    else:
        compute = _table(cost, label, swap)
    prefill_scale = None
    if cost.get("prefill_loop_scale") is not None:
        prefill_scale = _number(cost, "prefill_loop_scale", label, "cost")
    return ProfileCost(  # checks the values of the loop terms (`ProfileCost.__post_init__`)
        compute,
        loop_scale=_number(cost, "loop_scale", label, "cost"),
        prefill_loop_scale=prefill_scale,
        decode_loop_scales=_bins(cost.get("decode_loop_scales"), label),
        loop_base_ms=_number(cost, "loop_base_ms", label, "cost"),
        loop_request_ms=_number(cost, "loop_request_ms", label, "cost"),
        source=label,
    )


def _affine(cost: Mapping[str, object], label: str, swap: float) -> AffineCost:
    fields = _mapping(cost.get("affine"), label, "cost.affine")
    values = {name: _number(fields, name, label, "cost.affine", minimum=0.0) for name in AFFINE_FIELDS}
    for name in AFFINE_OPTIONAL:
        if name in fields:
            values[name] = _number(fields, name, label, "cost.affine", minimum=0.0)
    return AffineCost(**values, swap_ms_per_block=swap)


def _table(cost: Mapping[str, object], label: str, swap: float) -> TableCost:
    fields = _mapping(cost.get("table"), label, "cost.table")
    axes = [_int_list(fields, name, label) for name in TABLE_AXES]
    step_ms = fields.get("step_ms")
    if not isinstance(step_ms, list) or not all(_is_number(v) for v in step_ms):
        raise _error(label, "cost.table.step_ms", "must be a list of finite numbers")
    try:
        return TableCost(axes[0], axes[1], axes[2], tuple(float(v) for v in step_ms), label, swap)
    except CostSpecError as exc:
        raise CostSpecError(f"{label}: field 'cost.table': {exc}") from None


def _bins(value: object, label: str) -> tuple[tuple[int, float], ...]:
    """``decode_loop_scales``: absent, or [[count >= 1, scale > 0], ...] (`ProfileCost` checks
    that the counts increase)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_bin(pair) for pair in value):
        raise _error(
            label, "cost.decode_loop_scales", f"must be a list of [decode count >= 1, scale > 0], got {value!r}"
        )
    return tuple((int(pair[0]), float(pair[1])) for pair in value)


def _is_bin(pair: object) -> bool:
    if not isinstance(pair, list) or len(pair) != 2:
        return False
    count, scale = pair
    return isinstance(count, int) and not isinstance(count, bool) and count >= 1 and _is_number(scale) and scale > 0


def _mapping(value: object, label: str, field: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        what = "the document" if not field else f"field {field!r}"
        raise CostSpecError(f"{label}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def _number(fields: Mapping[str, object], name: str, label: str, owner: str, *, minimum: float | None = None) -> float:
    value = fields.get(name)
    if not _is_number(value) or (minimum is not None and float(value) < minimum):  # type: ignore[arg-type]
        bound = "a finite number" if minimum is None else f"a finite number >= {minimum:g}"
        raise _error(label, f"{owner}.{name}", f"must be {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _int_list(fields: Mapping[str, object], name: str, label: str) -> tuple[int, ...]:
    value = fields.get(name)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _error(label, f"cost.table.{name}", f"must be a list of integers, got {value!r}")
    return tuple(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _error(label: str, field: str, problem: str) -> CostSpecError:
    return CostSpecError(f"{label}: field {field!r}: {problem}")


def _field(name: str) -> str:
    """A `ProfileCost` attribute's field in the profile file (the speeds are none: spec parameters)."""
    return name if name.endswith("speed") else f"cost.{name}"


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def parse_profile(args: str) -> ProfileCost:
    """The `ProfileCost` of ``PATH[,model=affine|table][,speed=F][,prefill_speed=F]`` (the text
    after ``profile:``)."""
    path, params = split_path(args)
    if not path:
        raise CostSpecError("profile cost: expected profile:PATH.json[,model=affine|table][,speed=F][,prefill_speed=F]")
    values = split_params(params, known=PROFILE_PARAMS, what="profile cost")
    profile = load_profile(path, model=values.get("model"))
    speed, prefill_speed = (
        float_param(values[name], name, "profile cost", exclusive=True) if name in values else None
        for name in ("speed", "prefill_speed")
    )
    return profile.at_speed(profile.speed if speed is None else speed, prefill_speed)
