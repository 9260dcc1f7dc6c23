"""Server backends by name: `sim` (the simulator paced in real time) and `engine` (the real
PyTorch engine of `contbatch.engine`, imported only when asked for)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from contbatch.core.config import SchedulerConfig
from contbatch.server.backends.base import Backend, BackendError, ChatMessage

if TYPE_CHECKING:
    from contbatch.sim.cost import CostModel

BACKENDS: tuple[str, ...] = ("sim", "engine")


def make_backend(
    name: str,
    config: SchedulerConfig,
    *,
    cost: CostModel | None = None,
    model: str | None = None,
    served_model_name: str | None = None,
) -> Backend:
    """The backend `name`; `BackendError` for an unknown name or options it cannot use.

    `sim` needs `cost` (a cost model in seconds); `model` is only the name it serves under.
    `engine` needs `model`, a local checkpoint directory; `served_model_name` overrides its id.
    """
    if name == "sim":
        from contbatch.server.backends.sim import SimBackend

        if cost is None:
            raise BackendError("the sim backend needs a cost model (--cost affine)")
        return SimBackend(cost, config, model_name=served_model_name or model or "contbatch-sim")
    if name == "engine":
        from contbatch.server.backends.engine import make_engine_backend

        return make_engine_backend(config, model=model, served_model_name=served_model_name)
    raise BackendError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "BackendError", "ChatMessage", "make_backend"]
