"""Names a package exports but imports only when first asked for (PEP 562 module `__getattr__`).

A package whose `__init__` would otherwise import modules a common path never uses (the trace
loaders, the metrics' tables and exports, the loop's intake and text) lists those names here:
``__getattr__ = lazy_names(__name__, {"name": "submodule", ...})``, the names also imported under
`typing.TYPE_CHECKING` so that type checkers see them. Invariant: every such name resolves to
the same object an eager import would give, on its first use, and is then cached on the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_names(package: str, names: Mapping[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package` that imports each of `names` (name -> submodule) on first use."""

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
