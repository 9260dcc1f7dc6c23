"""SchedulerConfig: validation, presets, and `from_dict` errors that name the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from contbatch.core import make_scheduler
from contbatch.core.config import PRESETS, ConfigError, SchedulerConfig, preset_config, seed_config


def test_defaults_are_the_engine_preset_without_a_memory_limit() -> None:
    config = SchedulerConfig()
    assert dataclasses.replace(preset_config("engine"), kv=None) == config
    assert PRESETS["engine"].kv is not None and config.kv is None
    assert config.sample_on_prefill and config.chunked_prefill and not config.skip_blocked
    assert config.max_model_len is None


def test_seed_preset() -> None:
    config = seed_config()
    assert config == preset_config("seed")
    assert config.max_num_batched_tokens == 8
    assert config.max_num_seqs is None
    assert not config.sample_on_prefill and not config.chunked_prefill and config.skip_blocked
    assert seed_config(3).max_num_batched_tokens == 3


def test_config_is_frozen() -> None:
    config = SchedulerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 3  # type: ignore[misc]


def test_from_dict_overrides_a_preset() -> None:
    config = SchedulerConfig.from_dict({"max_num_batched_tokens": 16, "max_num_seqs": None})
    assert config == dataclasses.replace(SchedulerConfig(), max_num_batched_tokens=16, max_num_seqs=None)
    seeded = SchedulerConfig.from_dict({"skip_blocked": False}, base=seed_config())
    assert seeded == dataclasses.replace(seed_config(), skip_blocked=False)
    assert SchedulerConfig.from_dict({}) == SchedulerConfig()
    assert SchedulerConfig.from_dict({"max_model_len": 32}).max_model_len == 32


@pytest.mark.parametrize("keys", [["max_batched_tokens"], ["chunked", "bogus"]])
def test_from_dict_unknown_keys_are_named(keys: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        SchedulerConfig.from_dict(dict.fromkeys(keys, 1))
    for key in keys:
        assert key in str(info.value)


BAD_VALUES: list[tuple[str, Any]] = [
    ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", -8),
    ("max_num_batched_tokens", "8"),
    ("max_num_batched_tokens", 8.0),
    ("max_num_batched_tokens", True),
    ("max_num_batched_tokens", None),
    ("max_num_seqs", 0),
    ("max_num_seqs", "all"),
    ("max_num_seqs", 2.5),
    ("max_model_len", 0),
    ("max_model_len", -1),
    ("max_model_len", "long"),
    ("sample_on_prefill", "yes"),
    ("sample_on_prefill", 1),
    ("chunked_prefill", None),
    ("chunked_prefill", 0),
    ("skip_blocked", "false"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
@pytest.mark.parametrize("base", [None, seed_config()], ids=["engine", "seed"])
def test_from_dict_bad_values_name_the_field(field: str, value: Any, base: SchedulerConfig | None) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig.from_dict({field: value}, base=base)


@pytest.mark.parametrize(("field", "value"), BAD_VALUES[:6], ids=[f"{f}={v!r}" for f, v in BAD_VALUES[:6]])
def test_constructor_validates_too(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**{field: value})


def test_vllm_preset() -> None:
    config = preset_config("vllm")
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.chunked_prefill) == (8192, 256, True)
    assert config.kv is not None
    assert (config.kv.block_size, config.kv.watermark, config.kv.preemption) == (16, 0.0, "recompute")
    assert config.kv.admit_whole_sequence and config.kv.enable_prefix_caching


KV_BAD_VALUES: list[tuple[str, Any]] = [
    ("admit_whole_sequence", "yes"),
    ("admit_whole_sequence", 1),
    ("enable_prefix_caching", None),
    ("watermark", 1.5),
    ("block_size", 0),
    ("victim", "oldest"),
]


@pytest.mark.parametrize(("field", "value"), KV_BAD_VALUES, ids=[f"{f}={v!r}" for f, v in KV_BAD_VALUES])
def test_kv_bad_values_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"kv.{field}"):
        SchedulerConfig.from_dict({"kv": {field: value}}, base=preset_config("vllm"))


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="nope"):
        preset_config("nope")


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_make_scheduler_by_name() -> None:
    assert make_scheduler("static", seed_config()).name == "static"
    assert make_scheduler("continuous", seed_config()).name == "continuous"
    with pytest.raises(ConfigError, match="fifo"):
        make_scheduler("fifo", seed_config())
