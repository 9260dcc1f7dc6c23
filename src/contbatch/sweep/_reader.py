"""Reading parts of a sweep document, every problem a `SweepError` naming the file and the key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_SECTIONS: tuple[str, ...] = ("kv", "tenants", "lifecycle")


class SweepError(ValueError):
    """The sweep file is invalid; the message names the file and the key."""


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True, slots=True)
class Reader:
    source: str  # the file, as messages name it
    base_dir: Path  # relative trace paths start here

    def fail(self, key: str, problem: str) -> SweepError:
        return SweepError(f"{self.source}: {key}: {problem}" if key else f"{self.source}: {problem}")

    def mapping(self, key: str, value: object) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(key, f"expected a mapping, got {shown(value)}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise self.fail(key, f"keys must be strings, got {bad[0]!r}")
        return dict(value)

    def number(self, key: str, value: object, *, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or (positive and not value > 0):
            raise self.fail(key, f"expected a number{' > 0' if positive else ''}, got {shown(value)}")
        return float(value)

    def integer(self, key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {shown(value)}")
        return value

    def text(self, key: str, value: object) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(key, f"expected a non-empty string, got {shown(value)}")
        return value.strip()

    def values(self, key: str, value: object) -> tuple[Any, ...]:
        """A non-empty list of distinct values (scalars, or lists that become tuples)."""
        if not isinstance(value, list) or not value:
            raise self.fail(key, f"expected a non-empty list of values, got {shown(value)}")
        items = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        for i, item in enumerate(items):
            if isinstance(item, Mapping):
                raise self.fail(f"{key}[{i}]", f"expected a value, got a mapping {shown(item)}")
        if len(set(map(repr, items))) != len(items):
            raise self.fail(key, "values repeat")
        return items

    def config_key(self, key: str, where: str) -> list[str]:
        """`kv.num_blocks` → ["kv", "num_blocks"]; FIELD or SECTION.FIELD only."""
        parts = key.strip().replace("-", "_").split(".")
        if len(parts) > 2 or not all(parts) or (len(parts) == 2 and parts[0] not in CONFIG_SECTIONS):
            raise self.fail(where, f"bad config key {key!r}: expected FIELD or {{{','.join(CONFIG_SECTIONS)}}}.FIELD")
        return parts

    def put(self, values: dict[str, Any], key: str, value: object, where: str) -> None:
        """`kv.num_blocks: 8` goes to values["kv"]["num_blocks"]; `kv: {...}` merges into values["kv"]."""
        parts = self.config_key(key, where)
        if len(parts) == 1 and not (parts[0] in CONFIG_SECTIONS and isinstance(value, Mapping)):
            values[parts[0]] = value
            return
        nested = values.setdefault(parts[0], {})
        if not isinstance(nested, dict):
            raise self.fail(where, f"conflicts with {parts[0]}={nested!r}")
        if len(parts) == 2:
            nested[parts[1]] = value
        else:
            nested.update(self.mapping(where, value))
