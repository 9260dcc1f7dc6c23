"""The engine's exceptions. Each message names what is wrong and where (file, field, tensor)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, or its files are malformed or disagree with each other."""


class UnsupportedModel(ValueError):
    """A well-formed checkpoint uses something this engine does not implement (architecture, RoPE type, ...)."""
