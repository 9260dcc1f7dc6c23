"""The sweep file: YAML → a validated `SweepSpec` holding every grid point, or a `SweepError`.

Schema (top-level keys; only ``trace`` is required)::

    name: kv-budgets             # label of the results (default: the file's stem)
    trace: kv-pressure           # a built-in trace or a .jsonl/.csv path (relative to this file)
    rate: [2, 4, 8, 16]          # rescale arrivals to this mean rate (scale_to_rate); a list is an axis
    cost: affine                 # a cost model spec as for --cost (default unit:8); a list is an axis
    preset: engine               # default: seed for unit costs (token budget = C), engine otherwise
    set:                         # config overrides as --set: a mapping, or a list of "KEY=VALUE"
      kv.num_blocks: 2048
    scheduler: continuous        # default continuous; a list is an axis
    grid:                        # axis -> list of values; the grid is their cartesian product
      max_num_batched_tokens: [2048, 4096, 8192]
      kv.admission: [reserve, optimistic, estimate]
    slo: {ttft: 2.0, tpot: 0.1}  # latency objectives for goodput (clock unit)
    spec_acceptance: 1.0         # speculative decoding: draft acceptance probability
    seed: 0                      # the simulator's seed (draft acceptance draws)
    metrics: [p99_ttft, goodput] # result columns (summary / run-stat keys; default: default_metrics)
    plot: {metric: goodput, x: rate}   # what --plot draws (default metric: goodput with an SLO,
                                       # else output_throughput; default x: rate, else the last axis)
    fleet: {replicas: 4, router: least_outstanding}  # run each point on a fleet (contbatch.sweep.fleet)

Grid axes are ``scheduler``, ``cost``, ``rate``, any scheduler config key (``FIELD``,
``kv.FIELD``, ``tenants.FIELD``, ``lifecycle.FIELD``) or a fleet key (``fleet.router``,
``fleet.replicas``, ...: `contbatch.sweep.fleet`). A top-level list of ``scheduler``,
``cost`` or ``rate`` is an axis too, placed after the ``grid`` axes in that order; a key is
given once, at the top level or in the grid. Points are numbered in `itertools.product` order
of the axes (the last axis varies fastest); that is the results' order, whoever runs them.
Result columns and metric names: `contbatch.sweep.columns`.

Invariants of a `SweepSpec`: every point's config, cost model and trace were built and checked
here, so running a point cannot fail on its input; the trace and every cost model share one
clock unit; metric names were checked against the keys of a one-request probe run. Every
problem is a `SweepError` whose message starts with the file and names the key, e.g.
``sweep.yaml: grid.kv.admission[1]: scheduler config: kv.admission must be one of ...``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # (no stubs installed)

from contbatch.core import SCHEDULERS, ConfigError, SchedulerConfig, seed_config
from contbatch.core.config import PRESETS, parse_value
from contbatch.metrics import SLO
from contbatch.sim.cost import CostModel, CostSpecError, UnitCost, parse_cost
from contbatch.sweep._reader import Reader, SweepError, shown
from contbatch.sweep.columns import with_columns
from contbatch.sweep.fleet import checked_point_fleet, fleet_axis_name, is_fleet_axis
from contbatch.sweep.point import PointTask
from contbatch.traces import Trace, TraceError, builtin_trace_names, load_trace
from contbatch.traces.synthetic import scale_to_rate

SPECIAL_AXES: tuple[str, ...] = ("scheduler", "cost", "rate")
TOP_KEYS: tuple[str, ...] = (
    "name",
    "trace",
    "rate",
    "cost",
    "preset",
    "set",
    "scheduler",
    "grid",
    "slo",
    "spec_acceptance",
    "seed",
    "metrics",
    "plot",
    "fleet",
)


@dataclass(frozen=True, slots=True)
class Axis:
    name: str  # "scheduler", "cost", "rate" or a config key such as "kv.admission"
    key: str  # where the file gives it: "rate" or "grid.kv.admission"
    values: tuple[Any, ...]  # distinct, in the file's order (lists become tuples)


@dataclass(frozen=True, slots=True)
class GridPoint:
    index: int  # position in the product order of the axes
    values: tuple[tuple[str, Any], ...]  # (axis name, value) for every axis, in axis order
    scheduler: str
    cost: str  # the cost model spec
    rate: float | None  # the trace's mean rate; None: the trace as loaded
    config: SchedulerConfig
    fleet: dict[str, Any] | None = None  # the fleet it runs on (contbatch.sweep.fleet); None: one replica


@dataclass(frozen=True, slots=True)
class SweepSpec:
    source: str  # the file, for messages
    name: str
    trace: Trace  # as loaded, before any rate scaling
    time_unit: str  # the clock shared by the trace and every cost model
    preset: str | None  # as given; None: seed for unit costs, engine otherwise
    overrides: dict[str, Any]  # `set`, nested as SchedulerConfig.from_dict takes it
    axes: tuple[Axis, ...]
    points: tuple[GridPoint, ...]
    slo: SLO | None
    acceptance_rate: float
    seed: int
    metrics: tuple[str, ...]  # result columns after the axes; includes plot_metric
    plot_metric: str
    plot_x: str | None  # None: rate when it is an axis, else the last axis
    known_metrics: frozenset[str] | None  # scalar result keys (from the probe run); None: unchecked

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def trace_at(self, rate: float | None) -> Trace:
        """The trace a point runs: rescaled to mean rate `rate`, or as loaded."""
        return self.trace if rate is None else scale_to_rate(self.trace, rate)

    def task(self, point: GridPoint) -> PointTask:
        return PointTask(
            point.index,
            point.scheduler,
            point.config,
            point.cost,
            self.slo,
            self.acceptance_rate,
            self.seed,
            fleet=point.fleet,
        )


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and validate a sweep file (see the module docstring for the schema)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise SweepError(f"{file}: cannot read: {exc.strerror or exc}") from None
    return parse_sweep(text, source=str(file), base_dir=file.parent)


def parse_sweep(text: str, *, source: str = "<sweep>", base_dir: str | Path = ".") -> SweepSpec:
    """Validate a sweep document given as YAML text; relative trace paths start at `base_dir`."""
    reader = Reader(source, Path(base_dir))
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise reader.fail("", f"not valid YAML: {problem}{where}") from None
    doc = reader.mapping("", document if document is not None else {})
    unknown = sorted(set(doc) - set(TOP_KEYS))
    if unknown:
        raise reader.fail(unknown[0], f"unknown key; known: {', '.join(TOP_KEYS)}")
    if "trace" not in doc:
        raise reader.fail("trace", "missing: name a built-in trace or a trace file")
    return _build(reader, doc)


def _build(reader: Reader, doc: dict[str, Any]) -> SweepSpec:
    axes = _axes(reader, doc)
    costs = _costs(reader, doc, axes)
    time_unit = _time_unit(reader, costs)
    trace = _trace(reader, reader.text("trace", doc["trace"]), time_unit)
    _check_rates(reader, trace, doc, axes)
    preset = _preset(reader, doc.get("preset"))
    overrides = _overrides(reader, doc.get("set"))
    bases = {spec: _base(reader, preset, cost, overrides) for spec, cost in costs.items()}
    scheduler = _scheduler(reader, doc.get("scheduler", "continuous"))
    _check_axes(reader, axes, bases)
    spec = SweepSpec(
        source=reader.source,
        name=reader.text("name", doc["name"]) if "name" in doc else Path(reader.source).stem,
        trace=trace,
        time_unit=time_unit,
        preset=preset,
        overrides=overrides,
        axes=axes,
        points=_points(reader, axes, doc, scheduler, bases),
        slo=_slo(reader, doc.get("slo")),
        acceptance_rate=_acceptance(reader, doc.get("spec_acceptance", 1.0)),
        seed=reader.integer("seed", doc.get("seed", 0)),
        metrics=(),
        plot_metric="",
        plot_x=None,
        known_metrics=None,
    )
    return with_columns(reader, spec, doc)


def _axis_name(reader: Reader, key: str, where: str) -> str:
    name = key.strip().replace("-", "_")
    if name in SPECIAL_AXES:
        return name
    if is_fleet_axis(name):
        try:
            return fleet_axis_name(name)
        except ValueError as exc:
            raise reader.fail(where, str(exc)) from None
    return ".".join(reader.config_key(name, where))


def _axes(reader: Reader, doc: dict[str, Any]) -> tuple[Axis, ...]:
    grid = reader.mapping("grid", doc.get("grid") or {})
    axes = [
        Axis(_axis_name(reader, k, f"grid.{k}"), f"grid.{k}", reader.values(f"grid.{k}", v)) for k, v in grid.items()
    ]
    for axis in axes:
        if axis.name in SPECIAL_AXES and axis.name in doc:
            raise reader.fail(axis.name, f"given both at the top level and as {axis.key}; give it once")
    for name in SPECIAL_AXES:
        if isinstance(doc.get(name), list):
            axes.append(Axis(name, name, reader.values(name, doc[name])))
    names = [a.name for a in axes]
    for axis in axes:
        if names.count(axis.name) > 1:
            raise reader.fail(axis.key, f"axis {axis.name} is given twice")
    return tuple(axes)


def _axis(axes: tuple[Axis, ...], name: str) -> Axis | None:
    return next((a for a in axes if a.name == name), None)


def _entries(axes: tuple[Axis, ...], name: str, doc: dict[str, Any], default: object) -> list[tuple[str, object]]:
    """(key for messages, value) of every value a special key takes: an axis's, or the fixed one."""
    axis = _axis(axes, name)
    if axis is not None:
        return [(f"{axis.key}[{i}]", v) for i, v in enumerate(axis.values)]
    value = doc.get(name, default)
    return [] if value is None else [(name, value)]


def _costs(reader: Reader, doc: dict[str, Any], axes: tuple[Axis, ...]) -> dict[str, CostModel]:
    costs: dict[str, CostModel] = {}
    for where, raw in _entries(axes, "cost", doc, "unit:8"):
        spec = reader.text(where, raw)
        try:
            costs[spec] = parse_cost(spec)
        except CostSpecError as exc:
            raise reader.fail(where, str(exc)) from None
    return costs


def _time_unit(reader: Reader, costs: dict[str, CostModel]) -> str:
    units = sorted({cost.time_unit for cost in costs.values()})
    if len(units) > 1:
        raise reader.fail(
            "cost", f"cost models run on different clocks ({', '.join(units)}); sweep one clock at a time"
        )
    return units[0]


def _trace(reader: Reader, spec: str, time_unit: str) -> Trace:
    builtin = spec in builtin_trace_names()
    location = spec if builtin or Path(spec).is_absolute() else str(reader.base_dir / spec)
    try:
        trace = load_trace(location, time_unit=None if builtin else time_unit)
    except TraceError as exc:
        raise reader.fail("trace", str(exc)) from None
    if trace.time_unit != time_unit:
        hint = "unit:C" if trace.time_unit == "tick" else "affine"
        raise reader.fail(
            "trace", f"{spec} is timed in {trace.time_unit} units but the cost model's clock is {time_unit}; use {hint}"
        )
    return trace


def _check_rates(reader: Reader, trace: Trace, doc: dict[str, Any], axes: tuple[Axis, ...]) -> None:
    for where, rate in _entries(axes, "rate", doc, None):
        value = reader.number(where, rate, positive=True)
        try:
            scale_to_rate(trace, value)
        except ValueError as exc:
            raise reader.fail(where, str(exc)) from None


def _preset(reader: Reader, given: object) -> str | None:
    if given is None:
        return None
    name = reader.text("preset", given)
    if name not in PRESETS:
        raise reader.fail("preset", f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return name


def _scheduler(reader: Reader, given: object) -> str:
    if isinstance(given, list):  # an axis: checked with the others
        return "continuous"
    name = reader.text("scheduler", given)
    if name not in SCHEDULERS:
        raise reader.fail("scheduler", f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")
    return name


def _overrides(reader: Reader, given: object) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if isinstance(given, list):
        for i, item in enumerate(given):
            key, sep, raw = item.partition("=") if isinstance(item, str) else ("", "", "")
            if not sep or not key.strip():
                raise reader.fail(f"set[{i}]", f"expected KEY=VALUE, got {shown(item)}")
            reader.put(values, key, parse_value(raw.strip()), f"set[{i}]")
    elif given is not None:
        for key, value in reader.mapping("set", given).items():
            reader.put(values, key, tuple(value) if isinstance(value, list) else value, f"set.{key}")
    return values


def _base(reader: Reader, preset: str | None, cost: CostModel, overrides: dict[str, Any]) -> SchedulerConfig:
    name = preset or ("seed" if isinstance(cost, UnitCost) else "engine")
    base = seed_config(cost.capacity) if name == "seed" and isinstance(cost, UnitCost) else PRESETS[name]
    return _apply(reader, base, overrides, "set")


def _apply(reader: Reader, base: SchedulerConfig, change: dict[str, Any], where: str) -> SchedulerConfig:
    try:
        return SchedulerConfig.from_dict(change, base=base)
    except ConfigError as exc:
        raise reader.fail(where, str(exc)) from None


def _check_axes(reader: Reader, axes: tuple[Axis, ...], bases: dict[str, SchedulerConfig]) -> None:
    """Each axis value on its own (over each base config): a bad value is named by its index."""
    for axis in axes:
        for i, value in enumerate(axis.values):
            where = f"{axis.key}[{i}]"
            if axis.name == "scheduler" and value not in SCHEDULERS:
                raise reader.fail(where, f"unknown scheduler {value!r}; known: {', '.join(SCHEDULERS)}")
            if axis.name in SPECIAL_AXES or is_fleet_axis(axis.name):
                continue  # (fleet axes: checked as each point's fleet is built)
            for base in bases.values():
                if axis.name.startswith("kv.") and base.kv is None:
                    raise reader.fail(axis.key, "the config has no KV cache (kv=none); set kv.num_blocks under `set`")
                change: dict[str, Any] = {}
                reader.put(change, axis.name, value, where)
                _apply(reader, base, change, where)


def _points(
    reader: Reader, axes: tuple[Axis, ...], doc: dict[str, Any], scheduler: str, bases: dict[str, SchedulerConfig]
) -> tuple[GridPoint, ...]:
    fixed_cost = next(iter(bases))
    fixed_rate = doc.get("rate") if _axis(axes, "rate") is None else None
    points = []
    for index, combo in enumerate(itertools.product(*(a.values for a in axes))):
        values = tuple((a.name, v) for a, v in zip(axes, combo, strict=True))
        chosen = dict(values)
        where = "grid (point " + ", ".join(f"{n}={v!r}" for n, v in values) + ")"
        change: dict[str, Any] = {}
        for name, value in values:
            if name not in SPECIAL_AXES and not is_fleet_axis(name):
                reader.put(change, name, value, where)
        cost = str(chosen.get("cost", fixed_cost)).strip()
        rate = chosen.get("rate", fixed_rate)
        config = _apply(reader, bases[cost], change, where)
        scheduler_name = str(chosen.get("scheduler", scheduler))
        fleet = checked_point_fleet(reader, doc, values, (cost, config, scheduler_name), where)
        points.append(
            GridPoint(index, values, scheduler_name, cost, None if rate is None else float(rate), config, fleet)
        )
    return tuple(points)


def _slo(reader: Reader, given: object) -> SLO | None:
    if given is None:
        return None
    values = reader.mapping("slo", given)
    unknown = sorted(set(values) - {"ttft", "tpot", "e2e"})
    if unknown:
        raise reader.fail(f"slo.{unknown[0]}", "unknown objective; known: ttft, tpot, e2e")
    return SLO(**{k: reader.number(f"slo.{k}", v) for k, v in values.items() if v is not None})


def _acceptance(reader: Reader, given: object) -> float:
    value = reader.number("spec_acceptance", given)
    if not 0.0 <= value <= 1.0:
        raise reader.fail("spec_acceptance", f"must be in [0, 1], got {given!r}")
    return value
