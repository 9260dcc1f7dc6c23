"""The cost-spec error and the ``k=v`` parameter parsing shared by every cost model's spec.

`CostSpecError` lives here (and is re-exported by `contbatch.sim.cost`) so that the cost model
modules of this package can raise it without importing `contbatch.sim.cost`, which imports them.
"""

from __future__ import annotations

import math


class CostSpecError(ValueError):
    """A cost model name or parameter is invalid; the message says which."""


def split_params(args: str, *, known: tuple[str, ...], what: str) -> dict[str, str]:
    """``k=v,k=v`` as a dict; an item without ``=``, an unknown key or a repeated key is an error."""
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in args.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise CostSpecError(f"{what}: bad parameter {item!r}; expected k=v with k in {', '.join(known)}")
        if key in values:
            raise CostSpecError(f"{what}: parameter {key} given twice")
        values[key] = raw.strip()
    return values


def float_param(raw: str, key: str, what: str, *, minimum: float = 0.0, exclusive: bool = False) -> float:
    """``raw`` as a finite float >= ``minimum`` (> with ``exclusive``)."""
    try:
        value = float(raw)
    except ValueError:
        raise CostSpecError(f"{what}: parameter {key} must be a number, got {raw!r}") from None
    low_ok = value > minimum if exclusive else value >= minimum
    if not math.isfinite(value) or not low_ok:
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        raise CostSpecError(f"{what}: parameter {key} must be a finite number {bound}, got {raw!r}")
    return value


def int_param(raw: str, key: str, what: str, *, minimum: int = 1) -> int:
    """``raw`` as an int >= ``minimum``."""
    try:
        value = int(raw)
    except ValueError:
        raise CostSpecError(f"{what}: parameter {key} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise CostSpecError(f"{what}: parameter {key} must be an integer >= {minimum}, got {raw!r}")
    return value


def check_number(owner: str, name: str, value: object, *, minimum: float = 0.0, exclusive: bool = False) -> None:
    """Reject a non-number, bool, non-finite or out-of-range field of a spec dataclass."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > minimum if exclusive else value >= minimum  # type: ignore[operator]
    if not ok:
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        raise CostSpecError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")


def check_int(owner: str, name: str, value: object, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CostSpecError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")


def split_path(args: str) -> tuple[str, str]:
    """``PATH[,k=v...]`` as (PATH, "k=v,..."): trailing k=v items are peeled off one by one, so
    a path may itself contain commas."""
    path, params = args, ""
    while True:
        head, sep, tail = path.rpartition(",")
        if not sep or "=" not in tail:
            return path.strip(), params
        path, params = head, f"{tail},{params}"
