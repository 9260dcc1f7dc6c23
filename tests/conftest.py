"""What the whole suite shares: one torch thread per process, and the Hypothesis profiles.

Threads: xdist runs 2 workers on this 2-core machine, which may be busy with other work too. A
torch process with a pool of 2 intra-op threads then waits, at every parallel op, for a thread
that is not running: `contbatch run --trace seed-scaled` (tests/cli/test_engine_cmd.py) took
14 s alone, 188 s beside two busy loops and another torch process, and 20 s there with one
thread. So OMP_NUM_THREADS (and MKL_NUM_THREADS) default to 1, before anything imports torch;
CLI subprocesses inherit them. Set them to override.

Hypothesis profiles, chosen by the HYPOTHESIS_PROFILE environment variable
(or pytest's `--hypothesis-profile NAME`, which wins):

- `ci` (the default, what `make test` runs): 100 examples a test, derandomized (every run draws
  the same examples, so the gate is reproducible), no example database, a failing example
  printed as a reproduction blob;
- `fast` (`make test-fast`; `dev` is the same): 10 examples a test, random, with the example
  database, so a failure found once is replayed first next time;
- `thorough`: 1,000 examples a test, random (a long run before a release or after a change to
  the scheduler's core).

Every profile has no deadline and tolerates slow data generation (`HealthCheck.too_slow`): the
suite must pass on a loaded 2-core machine, where an example's wall time says nothing.

A test that needs more (or fewer) examples than the others states it as a multiple of the
profile's count, never as a fixed number, so that the profile scales it too:
``@settings(max_examples=4 * settings().max_examples)`` (`settings()` is the loaded profile).

The core under test is the compiled one where its build is current (`contbatch.compiled`; the
header says which). A test marked `interpreted` patches the core's internals, which compiled
code does not allow: with the compiled core it is skipped here and run on the Python core by
tests/test_compiled.py, which gets their node ids from the `interpreted_tests` fixture.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from contbatch import compiled

for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")

# what every profile shares: the wall time of an example is no signal on a loaded machine
_ANY_LOAD = settings(
    settings.get_profile("default"), deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("ci", _ANY_LOAD, max_examples=100, derandomize=True, database=None)
settings.register_profile("fast", _ANY_LOAD, max_examples=10)
settings.register_profile("dev", settings.get_profile("fast"))
settings.register_profile("thorough", _ANY_LOAD, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

INTERPRETED = pytest.StashKey[list[str]]()  # node ids of the collected tests marked `interpreted`


def pytest_report_header() -> str:
    return f"contbatch core: {compiled.describe()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if "interpreted" in item.keywords]
    config.stash[INTERPRETED] = [item.nodeid for item in marked]
    if compiled.in_use():
        skip = pytest.mark.skip(reason="patches the core's internals: tests/test_compiled.py runs it in Python")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture
def interpreted_tests(request: pytest.FixtureRequest) -> list[str]:
    return request.config.stash.get(INTERPRETED, [])


@pytest.fixture(autouse=True)
def thawed_collector() -> Iterator[None]:
    """`serve`, `route` and `bench` freeze the collector's heap before they run
    (`contbatch.cli.serve_cmd.freeze_startup_heap`); a test that runs one in this process has
    it thawed after, so that every test meets the collector as it was."""
    frozen = gc.get_freeze_count()
    yield
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
