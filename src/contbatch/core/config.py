"""The scheduler's configuration: one frozen dataclass, built from a plain dict or a preset.

Presets:
- `seed`: the teaching model of the contbatch specification. The prefill step computes only the
  prompt and samples nothing; the first output token comes from the first decode step after it.
  A prompt must fit the step's token budget whole (no chunking) and a waiting request that does
  not fit is skipped, so smaller ones behind it may still run. No sequence limit.
- `engine`: a real engine (vLLM-like). The step that completes the prompt samples the first
  output token; long prompts are chunked under the token budget; queue order is kept strictly
  (a blocked head blocks the requests behind it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value or name is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill + decode tokens)
    max_num_seqs: int | None = 256  # running requests at most; None: no limit
    sample_on_prefill: bool = True  # the step that completes a prompt samples the first token
    chunked_prefill: bool = True  # a prompt may be split across steps under the token budget
    skip_blocked: bool = False  # a waiting request that does not fit lets later ones pass
    max_model_len: int | None = None  # prompt + output tokens at most; None: no limit

    def __post_init__(self) -> None:
        _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_seqs is not None:
            _require_positive("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _require_positive("max_model_len", self.max_model_len)
        for name in ("sample_on_prefill", "chunked_prefill", "skip_blocked"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"scheduler config: {name} must be true or false")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, base: SchedulerConfig | None = None) -> SchedulerConfig:
        """`base` (default: the engine preset) with `values` replacing its fields; unknown keys
        and bad values raise ConfigError naming the field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"scheduler config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        try:
            return dataclasses.replace(base if base is not None else cls(), **values)
        except TypeError as exc:
            raise ConfigError(f"scheduler config: {exc}") from exc


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"scheduler config: {name} must be a positive integer, got {value!r}")


def seed_config(token_budget: int = 8) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=token_budget,
        max_num_seqs=None,
        sample_on_prefill=False,
        chunked_prefill=False,
        skip_blocked=True,
    )


PRESETS: dict[str, SchedulerConfig] = {
    "seed": seed_config(),
    "engine": SchedulerConfig(),
}


def preset_config(name: str) -> SchedulerConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
