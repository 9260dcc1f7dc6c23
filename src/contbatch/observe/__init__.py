"""contbatch.observe: predict a server you did not build, from its outside only.

- `plan`: the probe plan (a prefill grid, a decode concurrency sweep, open-loop runs at fractions
  of the capacity the first two estimate), pure data;
- `probe`: sends a plan through `contbatch.bench`'s client within a time budget and records every
  request's send time, chunk arrivals and usage (`observe`);
- `record`: the observation file (JSON lines) and its invariants;
- `servers`: the scheduler configurations of the servers people run (vllm, transformers-cb,
  sglang, tgi, contbatch), as presets over `contbatch.core.config.PRESETS`;
- `replay`: an observed run in the simulator, and its chunk times as linear functions of the
  cost terms;
- `fit`: the affine cost (and the delivery latency) whose simulated per-chunk timelines match
  the observed ones, with the objective stated there;
- `profile`: the profile file `fit` writes (read by ``--cost profile:PATH``);
- `validate`: predicted against observed on held-out runs, metric by metric.

The fit itself is `contbatch.observe.fit.fit` (not re-exported here: the name would hide the
module). It imports the bench client, the simulator and the metrics; never the engine or the server
(`validate` reuses the metric list of `contbatch.calibrate.validate`, which loads torch).
"""

from typing import TYPE_CHECKING

from contbatch.lazy import lazy_names

if TYPE_CHECKING:
    from contbatch.observe.fit import FitError, FitResult, Terms
    from contbatch.observe.plan import PHASES, PlanConfig
    from contbatch.observe.probe import ObserveConfig, ObserveError, observe, resolve_target
    from contbatch.observe.record import Observation, ObservationError, ObservedRequest, ObservedRun, load_observation
    from contbatch.observe.servers import SERVER_PRESETS, ServerPreset

# every name imported on first use: the CLI's parser reads `servers` alone, without the bench
# client (httpx) that `probe` and `record` load
_LAZY = {
    "FitError": "fit",
    "FitResult": "fit",
    "Terms": "fit",
    "PHASES": "plan",
    "PlanConfig": "plan",
    "ObserveConfig": "probe",
    "ObserveError": "probe",
    "observe": "probe",
    "resolve_target": "probe",
    "Observation": "record",
    "ObservationError": "record",
    "ObservedRequest": "record",
    "ObservedRun": "record",
    "load_observation": "record",
    "SERVER_PRESETS": "servers",
    "ServerPreset": "servers",
}

__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "PHASES",
    "SERVER_PRESETS",
    "FitError",
    "FitResult",
    "Observation",
    "ObservationError",
    "ObserveConfig",
    "ObserveError",
    "ObservedRequest",
    "ObservedRun",
    "PlanConfig",
    "ServerPreset",
    "Terms",
    "load_observation",
    "observe",
    "resolve_target",
]
