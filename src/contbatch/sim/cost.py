"""Cost models: what one step costs on the simulator's clock.

`CostModel` is a protocol with one method, `step_time(out) -> duration`, plus the unit of that
duration. Everything a step's cost may depend on is in its `SchedulerOutput` (the same contract
a real executor receives), so cost models are pure, frozen and deterministic.

- `UnitCost` (`unit:C`): the seed's teaching model. Every prompt, decode and padding token is one
  token-work; a step costs ceil(token-work / C) ticks, at least 1. Swaps are free in ticks.
- `AffineCost` (`affine[:k=v,...]`): seconds = base + per prefill token + per decode token +
  per KV position read by attention (padding priced as prefill work) + per KV block swapped
  between device and host (8 MB blocks of a 7B fp16 model over ~25 GB/s PCIe: 0.32 ms). The defaults resemble a
  7B model on one A100-80GB (fp16): a decode of one request at 576 tokens of context ~9.5 ms,
  32 such decodes ~16 ms, a 512-token prefill ~38 ms. They come from the shape of published
  vLLM step times for Llama-2-7B (weights read once per step ~9 ms; ~0.2 ms per extra decode
  request; ~0.056 ms per prefill token, i.e. ~250 TFLOP/s effective), not from a measurement
  made here: fit your own with a calibration profile.
- `RooflineCost` (`roofline:MODEL@DEVICE[xN][,k=v...]`, seconds): max(compute, memory) per step
  from a model and a device preset, with tensor and expert parallelism, MoE routing and swaps;
  `contbatch.sim.costs.roofline` states the model, `contbatch.sim.costs.presets` the figures.
- `TableCost` (`table:PATH[,k=v...]`, seconds): interpolated from a CSV grid of step times;
  `contbatch.sim.costs.table` states the format and the interpolation.
- `ProfileCost` (`profile:PATH[,model=affine|table][,speed=F]`, seconds): fitted to the real engine's own
  step times by `contbatch calibrate`; `contbatch.sim.costs.profile` states the model and format.

`COST_MODELS` is the registry: spec name -> `CostKind` (the spec's shape, a one-line help, and
the parser of the text after ``NAME:``). `parse_cost` builds any of them from a spec string; an
unknown name or parameter is a `CostSpecError` that names it and lists what is known.
`cost_help` is the registry in words (the CLI's ``--cost`` help). Adding a cost model: the model
and its parser (here when small, else in a module of `contbatch.sim.costs`), one `COST_MODELS`
entry, and a test (docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from contbatch.core.outputs import SchedulerOutput
from contbatch.sim.costs.errors import CostSpecError
from contbatch.sim.costs.presets import DEVICES, MODELS
from contbatch.sim.costs.roofline import RooflineCost
from contbatch.sim.costs.roofline_spec import ROOFLINE_PARAMS, parse_roofline
from contbatch.sim.costs.table import TABLE_PARAMS, TableCost, parse_table

__all__ = [
    "COST_MODELS",
    "AffineCost",
    "CostKind",
    "CostModel",
    "CostSpecError",
    "FixedPrice",
    "RooflineCost",
    "TableCost",
    "UnitCost",
    "cost_help",
    "parse_cost",
]


class CostModel(Protocol):
    @property
    def time_unit(self) -> str: ...  # "tick" or "s"

    def step_time(self, out: SchedulerOutput) -> float: ...


@dataclass(frozen=True, slots=True)
class UnitCost:
    capacity: int = 8  # token-work per tick

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise CostSpecError(f"unit cost: capacity must be a positive integer, got {self.capacity!r}")

    @property
    def time_unit(self) -> str:
        return "tick"

    def step_time(self, out: SchedulerOutput) -> float:
        work = out.num_batched_tokens + out.num_padding_tokens
        return float(max(1, math.ceil(work / self.capacity)))

    def decode_pricer(self, num_decodes: int, num_padding: int) -> FixedPrice:
        """`price(step_id, context)` of a step of `num_decodes` steady decodes: `step_time` of it,
        which does not depend on the step or the context."""
        return FixedPrice(float(max(1, math.ceil((num_decodes + num_padding) / self.capacity))))


@dataclass(frozen=True, slots=True)
class FixedPrice:
    """A decode pricer (`price(step_id, context)`) whose every step costs `value`: decode runs
    time a long stretch of such steps at once (`contbatch.sim.skip_ahead`)."""

    value: float

    def __call__(self, step_id: int, context: int) -> float:
        return self.value


@dataclass(frozen=True, slots=True)
class AffineCost:
    base_ms: float = 9.29  # per step: weights read once, launch and scheduling overhead
    prefill_ms: float = 0.056  # per prefill token (and per padding token)
    decode_ms: float = 0.066  # per decode token
    context_ms: float = 0.00025  # per KV position read by attention
    swap_ms_per_block: float = 0.32  # per KV block copied to or from host memory
    prefill_pair_ms: float = 0.0  # per (prefill token, position it attends to) pair: `prefill_token_pairs`
    batch_pair_ms: float = 0.0  # per (query token, KV position) pair of the whole batch: `batch_token_pairs`

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise CostSpecError(f"affine cost: {f.name} must be a finite number >= 0, got {value!r}")

    @property
    def time_unit(self) -> str:
        return "s"

    def step_time(self, out: SchedulerOutput) -> float:
        ms = (
            self.base_ms
            + self.prefill_ms * (out.num_prefill_tokens + out.num_padding_tokens)
            + self.decode_ms * out.num_decode_tokens
            + self.context_ms * out.num_context_tokens
            + self.swap_ms_per_block * out.num_swapped_blocks
        )
        if self.prefill_pair_ms and out.num_prefill_tokens:
            ms += self.prefill_pair_ms * prefill_token_pairs(out)
        if self.batch_pair_ms:
            ms += self.batch_pair_ms * batch_token_pairs(out)
        return ms / 1000.0


def prefill_token_pairs(out: SchedulerOutput) -> int:
    """The step's (prefill token, position it attends to) pairs: a prefill chunk of n tokens from
    position s computes n * s + n * (n + 1) / 2 of them under causal attention, the part of a long
    prompt's cost that grows with its square (decodes read their context: `num_context_tokens`)."""
    return sum(c.num_new_tokens * c.start + c.num_new_tokens * (c.num_new_tokens + 1) // 2
               for c in out.chunks if c.is_prefill)  # fmt: skip


def batch_token_pairs(out: SchedulerOutput) -> int:
    """The step's (query token, KV position) pairs over its whole packed batch: query tokens x
    KV positions read. A server that runs one dense masked attention over the packed batch,
    rather than one per request, computes every pair, the other requests' included:
    `transformers serve --continuous-batching` on CPU (its varlen path builds a mask of query
    tokens x (KV read + query tokens); its per-request decode path needs flash attention on a GPU)."""
    return out.num_batched_tokens * out.num_context_tokens


@dataclass(frozen=True, slots=True)
class CostKind:
    """One entry of `COST_MODELS`."""

    usage: str  # the spec's shape, e.g. "unit[:C]"
    time_unit: str  # the built model's `time_unit`: "tick" or "s"
    help: str  # one line: what it prices and the names it accepts
    parse: Callable[[str], CostModel]  # the text after "NAME:" ("" for none) -> the model; CostSpecError if bad


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _parse_unit(args: str) -> UnitCost:
    return UnitCost(_parse_int(args, "unit cost capacity") if args else 8)


def _parse_affine(args: str) -> AffineCost:
    return AffineCost(**_parse_floats(args, AffineCost))


def _parse_profile(args: str) -> CostModel:
    from contbatch.sim.costs.profile import parse_profile  # it imports this module: only here

    return parse_profile(args)


COST_MODELS: dict[str, CostKind] = {
    "unit": CostKind(
        "unit[:C]", "tick", "C token-work per tick, 8 if omitted; a step lasts at least 1 tick", _parse_unit
    ),
    "affine": CostKind(
        "affine[:k=v,...]",
        "s",
        f"a base per step plus per-token terms; k in {', '.join(_field_names(AffineCost))}",
        _parse_affine,
    ),
    "roofline": CostKind(
        "roofline:MODEL@DEVICE[xN][,k=v,...]",
        "s",
        f"max(compute, memory) of a model on N devices; MODEL in {', '.join(MODELS)}; "
        f"DEVICE in {', '.join(DEVICES)}; k in {', '.join(ROOFLINE_PARAMS)}",
        parse_roofline,
    ),
    "table": CostKind(
        "table:PATH.csv[,k=v]",
        "s",
        f"interpolated from a CSV grid of step times; k in {', '.join(TABLE_PARAMS)}",
        parse_table,
    ),
    "profile": CostKind(
        "profile:PATH.json[,model=affine|table][,speed=F]",
        "s",
        "fitted to the real engine's step times by contbatch calibrate; speed scales them",
        _parse_profile,
    ),
}
"""The cost models by spec name (the text before the first ``:``)."""

_UNIT_WORDS = {"tick": "ticks", "s": "seconds"}


def cost_help(time_unit: str | None = None) -> str:
    """The cost models (only those timed in `time_unit`, when given) in words: ``usage (unit: help)``
    per kind, joined by ``; ``."""
    return "; ".join(
        f"{kind.usage} ({_UNIT_WORDS.get(kind.time_unit, kind.time_unit)}: {kind.help})"
        for kind in COST_MODELS.values()
        if time_unit is None or kind.time_unit == time_unit
    )


def parse_cost(spec: str) -> CostModel:
    """`unit`, `unit:8`, `affine`, `affine:base_ms=8,decode_ms=0.07`, `roofline:llama-2-7b@a100`,
    `roofline:llama-3-70b@h100x4,eff=0.5`, `table:steps.csv`, `profile:profile.json`, ...: the
    `COST_MODELS` entry named before the first ``:`` parses the rest; CostSpecError otherwise."""
    name, _, args = spec.partition(":")
    kind = COST_MODELS.get(name)
    if kind is None:
        raise CostSpecError(f"unknown cost model {name!r}; known: {cost_help()}")
    return kind.parse(args)


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CostSpecError(f"{what} must be an integer, got {text!r}") from None


def _parse_floats(args: str, cls: type) -> dict[str, float]:
    known = set(_field_names(cls))
    values: dict[str, float] = {}
    for item in filter(None, args.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or key not in known:
            raise CostSpecError(f"bad cost parameter {item!r}; expected k=v with k in {', '.join(sorted(known))}")
        try:
            values[key] = float(raw)
        except ValueError:
            raise CostSpecError(f"cost parameter {key} must be a number, got {raw!r}") from None
    return values
