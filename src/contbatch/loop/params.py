"""`SamplingParams`: what a request asks of its generation, the one definition shared by the
offline engine, the server and the executors (the scheduler carries it opaquely as
`Request.params`).

Rules (vLLM's), applied to each logits row in this order:
1. `logit_bias`: the bias is added to the logit of its token id;
2. penalties: `repetition_penalty` divides a positive logit (multiplies a negative one) of every
   token that appears in the prompt or in the output so far; then `frequency_penalty` x (times
   the token appears in the output) and `presence_penalty` x (1 if it appears in the output) are
   subtracted (output tokens only, OpenAI's definition);
3. temperature below `GREEDY_TEMPERATURE` (1e-5, 0 included) is greedy: the argmax of the row
   after 1-2; otherwise logits / temperature;
4. `min_p` in [0, 1]: drop tokens whose probability is below min_p x the top token's;
5. top_k -1 or 0 disables it; otherwise keep the k largest logits;
6. top_p in (0, 1]; 1 disables it; otherwise keep the smallest set of most likely tokens whose
   probability reaches top_p (the most likely token always stays);
- a request with a `seed` draws from its own generator, so its tokens do not depend on what else
  is in the batch; a seed is any 64-bit integer, signed or not: [-2^63, 2^64 - 1];
- `logprobs` k (0 to `MAX_LOGPROBS`): each output token comes with its log-probability, its
  rank and the k most likely tokens; `prompt_logprobs` k: the same for every prompt token after
  the first. Log-probabilities are those of the model's raw distribution (log-softmax of the
  logits before any of the rules above), vLLM's default (``logprobs_mode=raw_logprobs``);
- `max_tokens` is enforced by the scheduler, stop token ids and EOS by the executor, stop
  strings by the loop's text stream.

Invariant: a constructed `SamplingParams` is valid (each field checked; ValueError names it).
`logit_bias` is normalised to a tuple of (token id, bias) pairs sorted by id (a mapping is
accepted), so the value stays hashable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for (vLLM's max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| at most (OpenAI's range)
MIN_SEED = -(1 << 63)
MAX_SEED = (1 << 64) - 1
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    items: Any = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((token, bias) for token, bias in items)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r}") from None
    for token, bias in pairs:
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
        if not _is_number(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token id twice")
    return tuple(sorted((t, float(b)) for t, b in pairs))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # >= 0; below GREEDY_TEMPERATURE means greedy
    top_k: int = -1  # -1 or 0: disabled; else >= 1
    top_p: float = 1.0  # in (0, 1]
    seed: int | None = None  # per-request generator seed, in [MIN_SEED, MAX_SEED]
    max_tokens: int | None = 16  # output tokens at most (None: up to the model length); the scheduler enforces it
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found (contbatch.loop.text)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request (besides EOS)
    ignore_eos: bool = False  # keep going past EOS
    min_p: float = 0.0  # in [0, 1]; 0 disables it
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]; 1 disables it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), sorted by id
    logprobs: int | None = None  # None: none; k: each output token's logprob plus the k most likely
    prompt_logprobs: int | None = None  # None: none; k: the same for each prompt token after the first

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias:
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        elif self.logit_bias is not None and not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", ())
        self._validate()

    def _validate(self) -> None:
        t = self.temperature
        if not _is_number(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be a 64-bit integer in [-2^63, 2^64 - 1] or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(_is_int(i) and i >= 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        self._validate_processing()

    def _validate_processing(self) -> None:
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {r!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether step 2 of the rules changes anything."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether steps 1-2 change the logits (so greedy is not the raw argmax)."""
        return bool(self.logit_bias) or self.has_penalties


GREEDY = SamplingParams(temperature=0.0)
