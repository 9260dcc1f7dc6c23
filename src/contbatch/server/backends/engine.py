"""The `engine` backend: the real PyTorch engine of `contbatch.engine`, behind the same server.

This module is only the registration point; the engine lives in `contbatch.engine` and is
imported here lazily (importing the server never imports torch). `contbatch.engine` exposes
`make_server_backend(config, *, model, served_model_name, kv_cache_memory, device, dtype)`: it loads the
checkpoint directory `model` (the built-in demo model when None), sizes `config` to the KV cache
it builds, and returns a `Backend` whose executor runs the model forward and sampling for one
`SchedulerOutput` (`contbatch.engine.executor.ModelExecutor`) and whose decoder is the model's
tokenizer.
"""

from __future__ import annotations

import importlib

from contbatch.core.config import SchedulerConfig
from contbatch.server.backends import BackendOptions
from contbatch.server.backends.base import Backend, BackendError

ENTRY_POINT = "make_server_backend"


def make_engine_backend(config: SchedulerConfig, options: BackendOptions) -> Backend:
    try:
        engine = importlib.import_module("contbatch.engine")
    except ImportError as exc:
        raise BackendError(f"the engine backend needs contbatch.engine: {exc}") from None
    entry = getattr(engine, ENTRY_POINT)
    extra: dict[str, object] = {"device": options.device, "dtype": options.dtype}
    if options.kv_cache_memory is not None:
        extra["kv_cache_memory"] = options.kv_cache_memory
    try:
        backend: Backend = entry(config, model=options.model, served_model_name=options.served_model_name, **extra)
    except (OSError, ValueError) as exc:  # an unreadable or unsupported checkpoint
        raise BackendError(f"cannot load the model: {exc}") from None
    return backend
