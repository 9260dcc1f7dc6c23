"""The server's engine leaves no OpenMP threads behind in the thread that loaded it.

libgomp cuts the spin-wait of every waiting OpenMP thread to about 100 turns once the process
holds more OpenMP threads than CPUs. A model loaded in the server's main thread would leave that
thread's OpenMP team alive beside the driver thread's, which steps the engine: its workers would
then sleep and be woken between nearly every two operations of a step. `make_server_backend`
therefore loads in a thread that ends with the load. The control loads with `load_model` in the
calling thread and must leave threads behind, or the check proves nothing.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from contbatch.engine.serving import in_passing_thread

PROBE = """
import os, sys, torch
torch.set_num_threads(2)
from contbatch.core.config import PRESETS
from contbatch.engine.load import load_model
from contbatch.engine.serving import make_server_backend

LOADS = {
    "server": lambda: make_server_backend(PRESETS["engine"], model=None, served_model_name="m"),
    "control": lambda: load_model(None),
}
before = set(os.listdir("/proc/self/task"))
loaded = LOADS[sys.argv[1]]()
print(len(set(os.listdir("/proc/self/task")) - before))
"""


def threads_left_by(load: str) -> int:
    """Threads the `load` of `PROBE` left running, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", PROBE, load], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="torch's parallel backend is not OpenMP")
def test_server_backend_load_leaves_no_openmp_team_behind() -> None:
    assert threads_left_by("control") >= 1  # loading in the calling thread leaves its team's workers
    assert threads_left_by("server") == 0


def test_in_passing_thread_returns_raises_and_ends() -> None:
    callers: list[threading.Thread] = []

    def answer() -> int:
        callers.append(threading.current_thread())
        return 42

    assert in_passing_thread(answer) == 42
    assert callers[0] is not threading.current_thread() and not callers[0].is_alive()
    with pytest.raises(ValueError, match="bad checkpoint"):
        in_passing_thread(lambda: int("bad checkpoint"))
