"""The router registry: a router from a spec string, the same for the simulator and a gateway.

A spec is ``NAME`` or ``NAME:KEY=VALUE,...``:

| spec | router |
|---|---|
| `round_robin` | each replica in turn |
| `least_outstanding` | fewest requests in flight |
| `least_kv` | lowest scraped KV usage, then fewest in flight |
| `least_work` | least priced work (waiting prompt tokens + remaining decode tokens) |
| `prefix_affinity[:load=1.25,vnodes=64,blocks=8]` | consistent hashing of the prompt prefix, bounded load |
| `weighted:SCORER=W,...` | weighted sum of scorers `prefix`, `queue`, `kv`, `load`, `work` |

`make_router(spec, pricer=...)` builds one (a fresh instance, with its own state, per call);
an unknown name, key or value is a `RouterSpecError` that names it and lists what is known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from contbatch.routing.routers import (
    KVScorer,
    LeastKV,
    LeastOutstanding,
    LeastWork,
    LoadScorer,
    PrefixAffinity,
    PrefixIndex,
    PrefixScorer,
    QueueScorer,
    RoundRobin,
    Router,
    Scorer,
    Weighted,
    WorkPricer,
    WorkScorer,
    count_tokens,
)


class RouterSpecError(ValueError):
    """A router spec names an unknown router, scorer or parameter, or a bad value."""


@dataclass(frozen=True, slots=True)
class _Context:
    pricer: WorkPricer
    prefix_capacity: int


@dataclass(frozen=True, slots=True)
class RouterKind:
    name: str
    help: str
    build: Callable[[dict[str, str], _Context], Router]


def _no_params(name: str, make: Callable[[_Context], Router]) -> Callable[[dict[str, str], _Context], Router]:
    def build(params: dict[str, str], context: _Context) -> Router:
        if params:
            raise RouterSpecError(f"router {name} takes no parameters, got {', '.join(params)}")
        return make(context)

    return build


def _number(router: str, key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise RouterSpecError(f"router {router}: {key}={text!r} is not a number") from None


def _affinity(params: dict[str, str], context: _Context) -> Router:
    known = {"load": 1.25, "vnodes": 64.0, "blocks": 8.0}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise RouterSpecError(f"router prefix_affinity: unknown parameter {unknown[0]!r}; known: load, vnodes, blocks")
    values = {k: _number("prefix_affinity", k, params[k]) if k in params else v for k, v in known.items()}
    try:
        return PrefixAffinity(values["load"], int(values["vnodes"]), int(values["blocks"]))
    except ValueError as exc:
        raise RouterSpecError(str(exc)) from None


SCORERS: dict[str, Callable[[_Context], Scorer]] = {
    "prefix": lambda c: PrefixScorer(PrefixIndex(c.prefix_capacity)),
    "queue": lambda c: QueueScorer(),
    "kv": lambda c: KVScorer(),
    "load": lambda c: LoadScorer(),
    "work": lambda c: WorkScorer(c.pricer),
}


def _weighted(params: dict[str, str], context: _Context) -> Router:
    if not params:
        raise RouterSpecError(f"router weighted needs scorers with weights, e.g. weighted:prefix=2,queue=1; "
                              f"scorers: {', '.join(SCORERS)}")  # fmt: skip
    parts = []
    for name, text in params.items():
        if name not in SCORERS:
            raise RouterSpecError(f"router weighted: unknown scorer {name!r}; known: {', '.join(SCORERS)}")
        weight = _number("weighted", name, text)
        if not weight > 0:
            raise RouterSpecError(f"router weighted: the weight of {name} must be > 0, got {text}")
        parts.append((weight, SCORERS[name](context)))
    return Weighted(parts)


ROUTERS: dict[str, RouterKind] = {
    kind.name: kind
    for kind in (
        RouterKind("round_robin", "each replica in turn", _no_params("round_robin", lambda c: RoundRobin())),
        RouterKind(
            "least_outstanding",
            "fewest requests in flight",
            _no_params("least_outstanding", lambda c: LeastOutstanding()),
        ),
        RouterKind("least_kv", "lowest scraped KV usage", _no_params("least_kv", lambda c: LeastKV())),
        RouterKind(
            "least_work",
            "least priced work: waiting prompt + remaining decode tokens",
            _no_params("least_work", lambda c: LeastWork(c.pricer)),
        ),
        RouterKind(
            "prefix_affinity",
            "consistent hashing of the prompt prefix with bounded load (load=1.25,vnodes=64,blocks=8)",
            _affinity,
        ),
        RouterKind(
            "weighted", "weighted scorers, e.g. weighted:prefix=2,queue=1 (prefix, queue, kv, load, work)", _weighted
        ),
    )
}


def parse_router_spec(spec: str) -> tuple[str, dict[str, str]]:
    """(name, parameters) of a spec; RouterSpecError for an unknown name or a malformed parameter."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().replace("-", "_")
    if name not in ROUTERS:
        raise RouterSpecError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise RouterSpecError(f"router {name}: expected KEY=VALUE, got {item!r}")
        params[key.strip()] = value.strip()
    return name, params


def make_router(spec: str, *, pricer: WorkPricer | None = None, prefix_capacity: int = 1 << 16) -> Router:
    """A new router from `spec` (see the module docstring). `pricer` prices `least_work` and the
    `work` scorer (default: tokens); `prefix_capacity` bounds the `prefix` scorer's index per replica."""
    name, params = parse_router_spec(spec)
    return ROUTERS[name].build(params, _Context(pricer or count_tokens, prefix_capacity))


def router_help() -> str:
    """The registry in words (for CLI help)."""
    return "; ".join(f"{kind.name} ({kind.help})" for kind in ROUTERS.values())
