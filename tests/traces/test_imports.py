"""contbatch.traces imports only the standard library (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
import contbatch.traces
contbatch.traces.load_trace("seed")
print(json.dumps(sorted(sys.modules)))
"""


def test_traces_import_only_the_standard_library() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    loaded = json.loads(result.stdout)
    # __main__ is the probe itself; _distutils_hack is setuptools' interpreter-startup shim.
    allowed_roots = set(sys.stdlib_module_names) | {"contbatch", "__main__", "_distutils_hack"}
    foreign = sorted(m for m in loaded if m.split(".")[0] not in allowed_roots)
    assert foreign == []
    ours = [m for m in loaded if m.startswith("contbatch.")]
    plumbing = ("contbatch.lazy", "contbatch.compiled")  # (both standard library only)
    assert ours and all(m.startswith("contbatch.traces") or m in plumbing for m in ours)
