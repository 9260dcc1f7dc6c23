"""The scheduler core: requests, timelines, the step contract, schedulers. Standard library only,
and no clock: every timestamp is an argument.
"""

from contbatch.core.base import SchedulerBase
from contbatch.core.config import PRESETS, ConfigError, SchedulerConfig, preset_config, seed_config
from contbatch.core.invariants import InvariantError, check_invariants
from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, StepResult, build_output
from contbatch.core.request import Request
from contbatch.core.scheduler import ContinuousScheduler
from contbatch.core.static import StaticScheduler
from contbatch.core.status import FinishReason, IllegalTransition, RequestStatus
from contbatch.core.timeline import Event, EventKind, Timeline, TimelineError

SCHEDULERS: dict[str, type[SchedulerBase]] = {
    "continuous": ContinuousScheduler,
    "static": StaticScheduler,
}


def make_scheduler(name: str, config: SchedulerConfig) -> SchedulerBase:
    """A scheduler by name (`continuous`, `static`); ConfigError for an unknown name."""
    try:
        cls = SCHEDULERS[name]
    except KeyError:
        raise ConfigError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}") from None
    return cls(config)


__all__ = [
    "PRESETS",
    "SCHEDULERS",
    "ConfigError",
    "ContinuousScheduler",
    "Event",
    "EventKind",
    "FinishReason",
    "IllegalTransition",
    "InvariantError",
    "Request",
    "RequestStatus",
    "ScheduledChunk",
    "SchedulerBase",
    "SchedulerConfig",
    "SchedulerOutput",
    "StaticScheduler",
    "StepResult",
    "Timeline",
    "TimelineError",
    "build_output",
    "check_invariants",
    "make_scheduler",
    "preset_config",
    "seed_config",
]
