"""The engine's exceptions. Each message names what is wrong and where (file, field, tensor)."""

from __future__ import annotations

from collections.abc import Iterable


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, or its files are malformed or disagree with each other."""


class UnsupportedModel(ValueError):
    """A well-formed checkpoint uses something this engine does not implement (architecture, RoPE type, ...)."""


class StepError(RuntimeError):
    """A model step failed; `request_ids` are the requests of that step (the engine fails only those).

    `cause` is the original exception (also chained as `__cause__`).
    """

    def __init__(self, request_ids: Iterable[str], cause: BaseException) -> None:
        self.request_ids: tuple[str, ...] = tuple(dict.fromkeys(request_ids))
        self.cause = cause
        super().__init__(f"step failed for requests {list(self.request_ids)}: {type(cause).__name__}: {cause}")
