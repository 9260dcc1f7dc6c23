"""Sending a probe plan to a server and recording what comes back (`observe`).

The HTTP client is `contbatch.bench` (`Target`, `runner.run`): every request streams, its send
time and every chunk's arrival are recorded on the run's clock. `observe` sends the plan's closed
runs (warm-up, prefill grid, the saturation run, decode sweep), takes the server's capacity from
them unless it was given (`plan.estimate_capacity`), then sends the open-loop runs at fractions
of it, appending each run to the file as soon as it is done (a run observed is never lost to a
later failure).

Time bound: runs are sent while the budget lasts; a run that would pass the budget's end is cut
there (its unfinished requests are cancelled by the client, recorded ``cancelled``), and the runs
after it are skipped. Progress: one line per run on the `progress` callback.

Machine drift (`PlanConfig.speed_probe`): before the first run and after every run, one fixed
request (`plan.speed_probe_run`) is sent alone; its median chunk gap (a one-request decode step,
plus the HTTP path) is the server's speed at that moment, and each run records the probe before
and after it as ``params.speed_probe_ms``. A server on a shared machine drifts by tens of percent
between minutes; `fit` and `validate --observed` price each run at the speed its probes found.

Server extensions (`detect_extensions`): ``ignore_eos`` (the output runs to ``max_tokens``) and
``stream_options.continuous_usage_stats`` (exact tokens per chunk) are used when one probe
request carrying them is answered 200; a strict server (``transformers serve`` answers 422)
gets plain OpenAI requests, and the observation records the lengths it chose.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from contbatch.bench.client import Target
from contbatch.bench.runner import RunConfig, run
from contbatch.observe.plan import PlanConfig, PlannedRun, closed_runs, estimate_capacity, open_runs, speed_probe_run
from contbatch.observe.record import Observation, ObservedRequest, ObservedRun, append_run, dump_observation, header


class ObserveError(ValueError):
    """The server cannot be observed (unreachable, no model, refuses every request); one line."""


@dataclass(frozen=True, slots=True)
class ObserveConfig:
    target: Target
    plan: PlanConfig
    budget_s: float = 300.0
    capacity_rps: float | None = None  # None: measured by the plan's saturation run
    timeout_s: float = 120.0  # per request: connect and between reads


def resolve_target(base_url: str, model: str | None, *, chat: bool, extensions: str) -> Target:
    """The target with its model (the server's first, when not given) and its extensions
    (``auto``: as `detect_extensions` finds; ``on``; ``off``)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with httpx.Client(timeout=10) as http:
            if model is None:
                response = http.get(root + "/v1/models")
                response.raise_for_status()
                found = [m.get("id") for m in response.json().get("data", []) if isinstance(m, dict)]
                if not found:
                    raise ObserveError(f"{root}/v1/models lists no model; give --model")
                model = str(found[0])
            target = Target(root, model, chat=chat)
            on = extensions == "on" or (extensions == "auto" and detect_extensions(http, target))
    except httpx.HTTPError as exc:
        raise ObserveError(f"cannot reach {root}: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:
        if isinstance(exc, ObserveError):
            raise
        raise ObserveError(f"{root}/v1/models: not an OpenAI model list ({exc})") from None
    return dataclasses.replace(target, ignore_eos=on, continuous_usage_stats=on)


def detect_extensions(http: httpx.Client, target: Target) -> bool:
    """Whether the server answers 200 to a one-token request with vLLM's extensions."""
    probe = dataclasses.replace(target, ignore_eos=True, continuous_usage_stats=True)
    from contbatch.bench.workload import BenchRequest

    body = probe.body(BenchRequest("probe", 0.0, "the", 1, 1))
    with http.stream("POST", target.url, json=body) as response:
        response.read()
        return response.status_code == 200


def _run(planned: PlannedRun, config: ObserveConfig, cut_s: float) -> ObservedRun:
    requests = [dataclasses.replace(r, cancel_offset_s=cut_s) for r in planned.requests]
    settings = RunConfig(max_concurrency=planned.max_concurrency, timeout_s=config.timeout_s, progress=False)
    records = asyncio.run(run(requests, config.target, settings))
    observed = tuple(ObservedRequest.of_record(record) for record in records)
    return ObservedRun(planned.name, planned.kind, planned.params, observed)


def _describe(run: ObservedRun, seconds: float) -> str:
    done = len(run.completed)
    tokens = sum(r.num_output_tokens for r in run.requests)
    ttfts = [r.chunk_ts[0] - r.send_ts for r in run.completed]
    ttft = f", median TTFT {1000 * statistics.median(ttfts):.1f} ms" if ttfts else ""
    return f"{run.name}: {done}/{len(run.requests)} completed, {tokens} tokens, {seconds:.1f} s{ttft}"


class _Session:
    """The runs sent so far, the speed probe around each, and the budget left."""

    def __init__(self, config: ObserveConfig, out: Path, progress: Callable[[str], None]) -> None:
        self.config, self.out, self.progress = config, out, progress
        self.started = time.monotonic()
        self.runs: list[ObservedRun] = []
        self.last_probe: float | None = None

    def left(self) -> float:
        return self.config.budget_s - (time.monotonic() - self.started)

    def probe(self) -> float | None:
        """The speed probe's median chunk gap now, in ms (None when off or it failed)."""
        if not self.config.plan.speed_probe:
            return None
        observed = _run(speed_probe_run(len(self.runs)), self.config, cut_s=max(self.left(), 1.0))
        gaps = [b - a for r in observed.completed for a, b in itertools.pairwise(r.chunk_ts)]
        return 1000 * statistics.median(gaps) if gaps else None

    def send(self, planned: PlannedRun) -> None:
        began = time.monotonic()
        before = self.last_probe if self.last_probe is not None else self.probe()
        observed = _run(planned, self.config, cut_s=self.left())
        self.last_probe = after = self.probe()
        if before is not None and after is not None:
            params = {**observed.params, "speed_probe_ms": [round(before, 4), round(after, 4)]}
            observed = dataclasses.replace(observed, params=params)
        self.runs.append(observed)
        append_run(observed, self.out)
        self.progress(f"[{len(self.runs)}] {_describe(observed, time.monotonic() - began)}")


def observe(config: ObserveConfig, out: Path, progress: Callable[[str], None] = lambda line: None) -> Observation:
    """Send the plan to `config.target` within the budget; write `out` as runs complete."""
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    target = {"url": config.target.root, "model": config.target.model, "chat": config.target.chat,
              "extensions": config.target.extensions}  # fmt: skip
    plan = {**config.plan.as_dict(), "budget_s": config.budget_s}
    dump_observation(Observation(header(target, plan, config.capacity_rps, created)), out)
    session = _Session(config, out, progress)
    capacity = config.capacity_rps
    for phase in ("closed", "open"):
        if phase == "open" and session.left() <= 0:
            break  # the closed phase said what it skipped
        if phase == "open" and capacity is None and "open" in config.plan.phases:
            capacity = _capacity(session.runs, config.plan)
            progress(f"capacity estimate: {capacity:.3g} requests/s" if capacity else "capacity: not estimated")
        queue = closed_runs(config.plan) if phase == "closed" else open_runs(config.plan, capacity) if capacity else []
        queue = [p for p in queue if p.name != "saturation" or config.capacity_rps is None]  # given: not measured
        for planned in queue:
            if session.left() <= 0:
                progress(f"budget of {config.budget_s:g} s spent: {planned.name} and the runs after it skipped")
                break
            session.send(planned)
    runs = session.runs
    if not any(r.completed for run in runs for r in run.requests):
        raise ObserveError(f"{config.target.url}: no request completed ({_first_error(runs)})")
    observation = Observation(header(target, plan, capacity, created), tuple(runs))
    dump_observation(observation, out)  # the header now holds the capacity used
    return observation


def _capacity(runs: list[ObservedRun], plan: PlanConfig) -> float | None:
    prompt = sum(plan.open_prompt) / 2
    output = sum(plan.open_output) / 2
    return estimate_capacity(runs, prompt, output)


def _first_error(runs: list[ObservedRun]) -> str:
    for observed in runs:
        for request in observed.requests:
            if request.error:
                return request.error
    return "no run was sent" if not runs else "every request failed"
