"""Server backends by name (`BACKENDS`): `sim` (the simulator paced in real time) and `engine`
(the real PyTorch engine of `contbatch.engine`, imported only when asked for).

Each entry is a factory taking the scheduler config and `BackendOptions`; adding a backend is
one module with its factory plus one entry here (and its test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contbatch.core.config import SchedulerConfig
from contbatch.server.backends.base import Backend, BackendError, ChatMessage

if TYPE_CHECKING:
    from contbatch.sim.cost import CostModel


@dataclass(frozen=True, slots=True)
class BackendOptions:
    cost: CostModel | None = None  # sim: the cost model (in seconds) its steps are paced by
    model: str | None = None  # engine: a local checkpoint directory (None: the demo model); sim: a name
    served_model_name: str | None = None  # the model id clients name (default: from `model`)
    kv_cache_memory: int | None = None  # engine: bytes of paged KV cache (None: the engine's default)
    device: str | None = None  # engine: cpu or cuda (None: cuda when present)
    dtype: str | None = None  # engine: float32, float16 or bfloat16 (None: float32 on CPU, the checkpoint's on CUDA)


def _sim(config: SchedulerConfig, options: BackendOptions) -> Backend:
    from contbatch.server.backends.sim import SimBackend

    if options.cost is None:
        raise BackendError("the sim backend needs a cost model (--cost affine)")
    name = options.served_model_name or options.model or "contbatch-sim"
    return SimBackend(options.cost, config, model_name=name)


def _engine(config: SchedulerConfig, options: BackendOptions) -> Backend:
    from contbatch.server.backends.engine import make_engine_backend

    return make_engine_backend(config, options)


BACKENDS: dict[str, Callable[[SchedulerConfig, BackendOptions], Backend]] = {"sim": _sim, "engine": _engine}


def make_backend(name: str, config: SchedulerConfig, options: BackendOptions | None = None) -> Backend:
    """The backend `name`; `BackendError` for an unknown name or options it cannot use."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    return factory(config, options or BackendOptions())


__all__ = ["BACKENDS", "Backend", "BackendError", "BackendOptions", "ChatMessage", "make_backend"]
