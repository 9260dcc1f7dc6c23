"""Running a sweep's points: in this process, in a local process pool, or on a Ray cluster.

Whoever runs them, each point is `run_point(trace, task)` on the same pickled inputs, and the
results are put back in grid order, so the rows of a sweep do not depend on the runner, the
number of workers or the order in which points finish. Each distinct trace (one per rate) is
shipped once: to each pool worker through its initializer, to Ray through the object store.

- `run_local(spec, workers=N)`: N worker processes (`concurrent.futures.ProcessPoolExecutor`);
  N = 1 runs in this process.
- `run_ray(spec, address=...)`: Ray tasks of one CPU each. ``"local"`` starts a Ray instance on
  this machine (``num_cpus=workers``), ``"auto"`` connects to the cluster this machine belongs
  to, anything else is passed to ``ray.init(address=...)`` (``ray://host:10001``). A Ray
  instance already initialized in this process is used as it is and left running; one started
  here is shut down afterwards. Every node must have contbatch installed.

A tqdm progress bar counts finished points on stderr (hidden when stderr is not a terminal,
unless `progress` is True).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from contbatch.sweep.point import PointTask, run_point
from contbatch.sweep.spec import SweepSpec
from contbatch.traces import Trace


@dataclass(frozen=True, slots=True)
class SweepResult:
    spec: SweepSpec
    summaries: tuple[dict[str, object], ...]  # per point, in grid order: the full summary or {"error": ...}

    @property
    def num_failed(self) -> int:
        return sum(1 for s in self.summaries if "error" in s)


class RayUnavailable(RuntimeError):
    """--ray was asked for but the ray package is not installed."""


def _traces(spec: SweepSpec) -> dict[float | None, Trace]:
    return {rate: spec.trace_at(rate) for rate in dict.fromkeys(p.rate for p in spec.points)}


def _progress(total: int, progress: bool | None) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]  # (no stubs installed)

    return tqdm(total=total, desc="sweep", unit="point", disable=None if progress is None else not progress)


def _collect(spec: SweepSpec, finished: Iterable[tuple[int, dict[str, object]]], progress: bool | None) -> SweepResult:
    results: dict[int, dict[str, object]] = {}
    with _progress(len(spec.points), progress) as bar:
        for index, summary in finished:
            results[index] = summary
            bar.update(1)
    return SweepResult(spec, tuple(results[p.index] for p in spec.points))


# -- local ---------------------------------------------------------------------------------

_WORKER_TRACES: dict[float | None, Trace] = {}


def _init_worker(traces: dict[float | None, Trace]) -> None:
    _WORKER_TRACES.clear()
    _WORKER_TRACES.update(traces)


def _run_in_worker(rate: float | None, task: PointTask) -> tuple[int, dict[str, object]]:
    return task.index, run_point(_WORKER_TRACES[rate], task)


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


def run_local(spec: SweepSpec, *, workers: int | None = None, progress: bool | None = None) -> SweepResult:
    """Every point of `spec`, `workers` processes at a time (default: one per CPU)."""
    count = min(workers or default_workers(), len(spec.points))
    traces = _traces(spec)
    if count <= 1:
        return _collect(spec, ((p.index, run_point(traces[p.rate], spec.task(p))) for p in spec.points), progress)
    with ProcessPoolExecutor(max_workers=count, initializer=_init_worker, initargs=(traces,)) as pool:
        futures = [pool.submit(_run_in_worker, p.rate, spec.task(p)) for p in spec.points]
        return _collect(spec, (f.result() for f in as_completed(futures)), progress)


# -- Ray -----------------------------------------------------------------------------------


def _ray_module() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs the ray package: pip install 'contbatch[ray]'") from None
    return ray


def _ray_init(ray: Any, address: str, workers: int | None) -> bool:
    """Connect or start as `address` says; True if this call started the connection."""
    if ray.is_initialized():
        return False
    if address == "local":
        ray.init(num_cpus=workers or default_workers(), include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def run_ray(
    spec: SweepSpec, *, address: str = "local", workers: int | None = None, progress: bool | None = None
) -> SweepResult:
    """Every point of `spec` as a Ray task (see the module docstring for `address`)."""
    ray = _ray_module()
    started = _ray_init(ray, address, workers)
    try:
        remote: Callable[..., Any] = ray.remote(num_cpus=1)(run_point).remote
        refs = {rate: ray.put(trace) for rate, trace in _traces(spec).items()}
        pending = {remote(refs[p.rate], spec.task(p)): p.index for p in spec.points}

        def finished() -> Iterable[tuple[int, dict[str, object]]]:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    yield pending.pop(ref), ray.get(ref)

        return _collect(spec, finished(), progress)
    finally:
        if started:
            ray.shutdown()
