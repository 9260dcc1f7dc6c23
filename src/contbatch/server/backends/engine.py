"""The `engine` backend: the real PyTorch engine of `contbatch.engine`, behind the same server.

This module is only the registration point; the engine lives in `contbatch.engine` and is
imported here lazily (importing the server never imports torch). The contract that package
fulfils, by exposing one function::

    contbatch.engine.make_server_backend(
        config: SchedulerConfig, *, model: str, served_model_name: str | None
    ) -> contbatch.server.backends.base.Backend

It loads the checkpoint directory `model` (the built-in demo model when None), may adjust
`config` (e.g. size the KV cache from the memory it finds) and returns a `Backend`: a tokenizer
and chat template usable from any thread, and an executor (`contbatch.server.executor.Executor`)
whose `execute(out)` runs the model forward and sampling for one `SchedulerOutput` (sampling
parameters come with `add_request`; finished requests are in `out.finished_ids`), and whose
`detokenize` turns output ids into text incrementally.
"""

from __future__ import annotations

import importlib

from contbatch.core.config import SchedulerConfig
from contbatch.server.backends.base import Backend, BackendError

ENTRY_POINT = "make_server_backend"
MISSING = "the engine backend needs contbatch.engine (issue: the real engine)"


def make_engine_backend(config: SchedulerConfig, *, model: str | None, served_model_name: str | None) -> Backend:
    try:
        engine = importlib.import_module("contbatch.engine")
    except ImportError as exc:
        raise BackendError(f"{MISSING}: {exc}") from None
    entry = getattr(engine, ENTRY_POINT, None)
    if entry is None:
        raise BackendError(f"{MISSING}: contbatch.engine has no {ENTRY_POINT}() entry point yet")
    try:
        backend: Backend = entry(config, model=model, served_model_name=served_model_name)
    except (OSError, ValueError) as exc:  # an unreadable or unsupported checkpoint
        raise BackendError(f"cannot load the model: {exc}") from None
    return backend
