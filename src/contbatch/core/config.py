"""The scheduler's configuration: two small frozen dataclasses, built from plain dicts or presets.

`SchedulerConfig` holds the per-step budgets and the order rules; `KVConfig` (its `kv` field, or
None for no memory limit) holds the paged-KV budget and what happens when it runs out;
`TenantConfig` (`tenants`) holds fair-share weights and per-tenant quotas; `LifecycleConfig`
(`lifecycle`) holds timeouts, the waiting-queue bound and streaming backpressure.

Presets:
- `seed`: the teaching model of the contbatch specification. The prefill step computes only the
  prompt and samples nothing; the first output token comes from the first decode step after it.
  A prompt must fit the step's token budget whole (no chunking) and a waiting request that does
  not fit is skipped, so smaller ones behind it may still run. No sequence or memory limit.
- `engine`: a real engine (vLLM-like). The step that completes the prompt samples the first
  output token; long prompts are chunked under the token budget; queue order is strict; a paged
  KV cache of 6,144 blocks of 16 tokens (98,304 tokens: about what a 7B fp16 model leaves free
  on an 80 GB GPU) with optimistic admission and preemption by recompute of the newest request.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contbatch.core.queue import QUEUE_ORDERS


class ConfigError(ValueError):
    """A configuration value or name is invalid; the message names the field."""


def _is_number(value: object, *, minimum: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"scheduler config: {name} must be {kind}, got {value!r}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"scheduler config: {name} must be true or false, got {value!r}")


def _require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"scheduler config: {name} must be one of {', '.join(choices)}, got {value!r}")


def _require_fraction(name: str, value: object) -> None:
    if not _is_number(value, minimum=0.0) or float(value) > 1.0:  # type: ignore[arg-type]
        raise ConfigError(f"scheduler config: {name} must be a number in [0, 1], got {value!r}")


ADMISSION_MODES = ("reserve", "optimistic", "estimate")
PAUSE_ACTIONS = ("preempt", "cancel")
PREEMPTION_MODES = ("recompute", "swap")
VICTIM_CHOICES = ("newest", "lowest_priority", "fewest_generated")


@dataclass(frozen=True, slots=True)
class KVConfig:
    block_size: int = 16  # tokens per block
    num_blocks: int = 6144  # device blocks
    num_host_blocks: int = 0  # host blocks for swapping; when full, swap falls back to recompute
    watermark: float = 0.01  # optimistic/estimate admission keeps this fraction of blocks free
    enable_prefix_caching: bool = False  # share full blocks (prompt or output) with equal chained hashes
    # reserve: prompt + max output reserved at admission, never preempts (TensorRT-LLM, TGI);
    # optimistic: only the scheduled chunk must fit, running requests grow and may be preempted (vLLM);
    # estimate: admit against an estimate of future growth (SGLang's new-token ratio)
    admission: str = "optimistic"
    preemption: str = "recompute"  # recompute (drop the KV) or swap (park it in host blocks)
    victim: str = "newest"  # newest admitted, lowest priority (largest value), fewest generated tokens
    # admission waits until blocks for the request's whole known sequence are free (vLLM V1's
    # scheduler_reserve_full_isl), though it takes only the first chunk's
    admit_whole_sequence: bool = False
    max_preemptions: int | None = None  # a request preempted this often is a victim only as a last resort
    estimate_init_ratio: float = 0.7  # estimate: expected fraction of the remaining output still to come
    estimate_min_ratio: float = 0.1  # ... the floor it decays to
    estimate_decay: float = 0.001  # ... decrease per step
    estimate_bump: float = 0.3  # ... increase after a step that preempted (capped at 1)

    def __post_init__(self) -> None:
        _require_int("kv.block_size", self.block_size, minimum=1)
        _require_int("kv.num_blocks", self.num_blocks, minimum=1)
        _require_int("kv.num_host_blocks", self.num_host_blocks, minimum=0)
        if self.max_preemptions is not None:
            _require_int("kv.max_preemptions", self.max_preemptions, minimum=1)
        _require_bool("kv.enable_prefix_caching", self.enable_prefix_caching)
        _require_bool("kv.admit_whole_sequence", self.admit_whole_sequence)
        _require_choice("kv.admission", self.admission, ADMISSION_MODES)
        _require_choice("kv.preemption", self.preemption, PREEMPTION_MODES)
        _require_choice("kv.victim", self.victim, VICTIM_CHOICES)
        for name in ("watermark", "estimate_init_ratio", "estimate_min_ratio", "estimate_decay", "estimate_bump"):
            _require_fraction(f"kv.{name}", getattr(self, name))


@dataclass(frozen=True, slots=True)
class TenantConfig:
    weights: tuple[tuple[str, float], ...] = ()  # (tenant, weight) for `fair`; others weigh 1
    max_running: int | None = None  # running requests per tenant at most
    max_kv_blocks: int | None = None  # KV blocks a tenant's running requests may hold (admission and growth)

    def __post_init__(self) -> None:
        raw: Any = self.weights
        if isinstance(raw, Mapping):
            raw = tuple(sorted((str(k), v) for k, v in raw.items()))
        elif isinstance(raw, str):
            raw = (raw,)
        if isinstance(raw, tuple):  # "name:weight" strings come from the command line
            raw = tuple(_parse_weight(w) if isinstance(w, str) else w for w in raw)
        object.__setattr__(self, "weights", raw)
        for item in raw:
            if not (isinstance(item, tuple) and len(item) == 2 and _is_number(item[1], minimum=0.0) and item[1] > 0):
                raise ConfigError(f"scheduler config: tenants.weights entries must be (tenant, weight > 0): {item!r}")
        for name in ("max_running", "max_kv_blocks"):
            if getattr(self, name) is not None:
                _require_int(f"tenants.{name}", getattr(self, name), minimum=1)

    @property
    def weight_map(self) -> dict[str, float]:
        return dict(self.weights)


def _parse_weight(text: str) -> tuple[str, float]:
    name, sep, raw = text.rpartition(":")
    try:
        return (name, float(raw)) if sep and name else (text, float("nan"))
    except ValueError:
        raise ConfigError(f"scheduler config: tenants.weights entry {text!r} is not NAME:WEIGHT") from None


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    ttft_timeout: float | None = None  # a request with no output token this long after arrival times out
    request_timeout: float | None = None  # a request unfinished this long after arrival times out
    max_waiting: int | None = None  # a full waiting queue rejects new requests (beyond free running slots)
    output_credits: int | None = None  # tokens generated but not yet read by the client, at most
    max_pause: float | None = None  # a request paused (credits exhausted) this long is ...
    pause_action: str = "preempt"  # ... preempted (its KV freed) or cancelled

    def __post_init__(self) -> None:
        for name in ("ttft_timeout", "request_timeout", "max_pause"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value, minimum=0.0) and value > 0):
                raise ConfigError(f"scheduler config: lifecycle.{name} must be a number > 0, got {value!r}")
        for name in ("max_waiting", "output_credits"):
            if getattr(self, name) is not None:
                _require_int(f"lifecycle.{name}", getattr(self, name), minimum=1)
        _require_choice("lifecycle.pause_action", self.pause_action, PAUSE_ACTIONS)

    @property
    def has_timeouts(self) -> bool:
        return self.ttft_timeout is not None or self.request_timeout is not None or self.max_pause is not None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill + decode tokens)
    max_num_seqs: int | None = 256  # running requests at most; None: no limit
    max_model_len: int | None = None  # prompt + output tokens at most; None: no limit
    sample_on_prefill: bool = True  # the step that completes a prompt samples the first token
    chunked_prefill: bool = True  # a prompt may be split across steps under the token budget
    max_prefill_tokens_per_request: int | None = None  # cap on one request's prefill chunk (chunked only)
    max_partial_prefills: int | None = None  # cap on requests holding a partial prefill at once
    defer_partial_prefills: bool = False  # no new split prefill in a step that already yields a prompt's first token
    prefill_first: bool = False  # prefills take the budget before decodes (False: decodes first, stall-free)
    skip_blocked: bool = False  # a waiting request that does not fit lets later ones pass
    max_skip_age: float | None = None  # ... unless it has waited this long (clock units); None: no limit
    batch_buckets: tuple[int, ...] = ()  # allowed step sizes in tokens (CUDA-graph captures); () = none
    num_speculative_tokens: int = 0  # draft tokens verified per decode step (engine semantics only)
    queue_order: str = "fcfs"  # a name in contbatch.core.queue.QUEUE_ORDERS
    aging_rate: float = 1.0  # aging: priority levels gained per clock unit of waiting
    priority_preemption: int | None = None  # a waiting request whose priority value is this much lower preempts
    kv: KVConfig | None = None  # paged-KV memory; None: unlimited
    tenants: TenantConfig = TenantConfig()
    lifecycle: LifecycleConfig = LifecycleConfig()

    def __post_init__(self) -> None:
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        for name in ("max_num_seqs", "max_model_len", "max_prefill_tokens_per_request", "max_partial_prefills"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), minimum=1)
        _require_int("num_speculative_tokens", self.num_speculative_tokens, minimum=0)
        for name in ("sample_on_prefill", "chunked_prefill", "prefill_first", "skip_blocked", "defer_partial_prefills"):
            _require_bool(name, getattr(self, name))
        if self.max_skip_age is not None and not _is_number(self.max_skip_age, minimum=0.0):
            raise ConfigError(f"scheduler config: max_skip_age must be a number >= 0, got {self.max_skip_age!r}")
        self._check_buckets()
        _require_choice("queue_order", self.queue_order, tuple(QUEUE_ORDERS))
        if not _is_number(self.aging_rate, minimum=0.0) or self.aging_rate <= 0:
            raise ConfigError(f"scheduler config: aging_rate must be a number > 0, got {self.aging_rate!r}")
        if self.priority_preemption is not None:
            _require_int("priority_preemption", self.priority_preemption, minimum=1)
        for name, cls in (("kv", KVConfig), ("tenants", TenantConfig), ("lifecycle", LifecycleConfig)):
            value = getattr(self, name)
            if not isinstance(value, cls) and not (name == "kv" and value is None):
                raise ConfigError(f"scheduler config: {name} must be a {cls.__name__}, got {value!r}")
        self._check_engine_semantics()

    def _check_engine_semantics(self) -> None:
        """Fields that mean something only where the step completing a prompt samples its first token."""
        if self.sample_on_prefill:
            return
        if self.num_speculative_tokens:
            raise ConfigError("scheduler config: num_speculative_tokens needs sample_on_prefill (engine semantics)")
        if self.defer_partial_prefills:
            raise ConfigError("scheduler config: defer_partial_prefills needs sample_on_prefill (engine semantics)")

    def _check_buckets(self) -> None:
        buckets = self.batch_buckets
        if not isinstance(buckets, tuple) or not all(isinstance(b, int) and b >= 1 for b in buckets):
            raise ConfigError(f"scheduler config: batch_buckets must be positive integers, got {buckets!r}")
        if list(buckets) != sorted(set(buckets)):
            raise ConfigError(f"scheduler config: batch_buckets must be strictly increasing, got {buckets!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, base: SchedulerConfig | None = None) -> SchedulerConfig:
        """`base` (default: `SchedulerConfig()`) with `values` replacing its fields. `kv` may be
        None, a KVConfig, or a dict of KVConfig fields applied over the base's KV config (or the
        defaults); `tenants` and `lifecycle` take dicts of their fields too. Unknown keys and bad
        values raise ConfigError naming the field."""
        base = base if base is not None else cls()
        values = dict(values)
        if isinstance(values.get("kv"), Mapping):
            values["kv"] = _replace(KVConfig, base.kv or KVConfig(), values["kv"], prefix="kv.")
        if isinstance(values.get("tenants"), Mapping):
            values["tenants"] = _replace(TenantConfig, base.tenants, values["tenants"], prefix="tenants.")
        if isinstance(values.get("lifecycle"), Mapping):
            values["lifecycle"] = _replace(LifecycleConfig, base.lifecycle, values["lifecycle"], prefix="lifecycle.")
        if isinstance(values.get("batch_buckets"), list):
            values["batch_buckets"] = tuple(values["batch_buckets"])
        config: SchedulerConfig = _replace(cls, base, values, prefix="")
        return config


def _replace(cls: type[Any], base: Any, values: Mapping[str, Any], *, prefix: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        names = ", ".join(prefix + u for u in unknown)
        raise ConfigError(f"scheduler config: unknown field(s) {names}; known: {', '.join(sorted(known))}")
    try:
        return dataclasses.replace(base, **values)
    except TypeError as exc:
        raise ConfigError(f"scheduler config: {exc}") from exc


def parse_value(raw: str) -> object:
    """A config field's value written as text (`--set KEY=VALUE`, sweep files): true/false,
    none/null, 1/2/4 (a tuple), an int, a float, else the text itself."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    if "/" in raw:
        return tuple(parse_value(part) for part in raw.split("/") if part)
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


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
    "engine": SchedulerConfig(kv=KVConfig()),
    # vLLM V1 (0.33) as served on a large GPU: 8,192-token budget, 256 sequences, chunked prefill,
    # 16-token blocks, prefix caching, no watermark, recompute the newest; step for step equal to
    # vLLM's scheduler on its anchor driver (benchmarks/vllm_decisions.py)
    "vllm": SchedulerConfig(kv=KVConfig(watermark=0.0, admit_whole_sequence=True, enable_prefix_caching=True)),
}


def preset_config(name: str) -> SchedulerConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
