"""`SamplingParams`: what a request asks of its generation, the one definition shared by the
offline engine, the server and the executors (the scheduler carries it opaquely as
`Request.params`).

Rules (vLLM's):
- temperature == 0 is greedy (argmax); otherwise logits / temperature;
- top_k -1 or 0 disables it; otherwise keep the k largest logits;
- top_p in (0, 1]; 1 disables it; otherwise keep the smallest set of most likely tokens whose
  probability reaches top_p (the most likely token always stays);
- a request with a `seed` draws from its own generator, so its tokens do not depend on what else
  is in the batch;
- `max_tokens` is enforced by the scheduler, stop token ids and EOS by the executor, stop
  strings by the loop's text stream.

Invariant: a constructed `SamplingParams` is valid (each field checked; ValueError names it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_k: int = -1  # -1 or 0: disabled; else >= 1
    top_p: float = 1.0  # in (0, 1]
    seed: int | None = None  # per-request generator seed
    max_tokens: int | None = 16  # output tokens at most (None: up to the model length); the scheduler enforces it
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found (contbatch.loop.text)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request (besides EOS)
    ignore_eos: bool = False  # keep going past EOS

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 disables it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(_is_int(i) and i >= 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)
