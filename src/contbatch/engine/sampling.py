"""`SamplingParams` (per request) and `Sampler` (one batch of logits rows, per-row params).

Rules (vLLM's):
- temperature == 0 is greedy (argmax); otherwise logits / temperature;
- top_k -1 or 0 disables it; otherwise keep the k largest logits;
- top_p in (0, 1]; 1 disables it; otherwise keep the smallest set of most likely tokens whose
  probability reaches top_p (the most likely token always stays);
- a request with a `seed` draws from its own `torch.Generator`, so its tokens do not depend on
  what else is in the batch; requests without one share the sampler's seeded generator.

Invariant: every sampled id is in [0, vocab) and has a nonzero probability after the filters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_k: int = -1  # -1 or 0: disabled; else >= 1
    top_p: float = 1.0  # in (0, 1]
    seed: int | None = None  # per-request generator seed
    max_tokens: int | None = 16  # output tokens at most (None: up to the model length); the scheduler enforces it
    stop: tuple[str, ...] = ()  # stop strings (the engine loop checks them with the detokenizer)
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

    def make_generator(self) -> torch.Generator | None:
        """A CPU generator seeded with `seed` (None without a seed)."""
        if self.seed is None:
            return None
        return torch.Generator(device="cpu").manual_seed(self.seed)


GREEDY = SamplingParams(temperature=0.0)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of `logits` with everything outside top-k / top-p set to -inf; top_k 0 means all."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps the first token).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Samples one token per logits row, each row with its own `SamplingParams` and generator."""

    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator(device="cpu").manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] = (),
    ) -> list[int]:
        """Token ids for `logits` [R, vocab]; `generators[i]` (None: the shared one) draws row i."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logits rows but {len(params)} sampling params")
        result = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            drawn = self._sample_random(logits, random_rows, params, generators)
            for i, token in zip(random_rows, drawn, strict=True):
                result[i] = token
        return result

    def _sample_random(
        self,
        logits: torch.Tensor,
        rows: list[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        device = logits.device
        chosen = [params[i] for i in rows]
        x = logits[rows].float()
        x = x / torch.tensor([p.temperature for p in chosen], device=device)[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in chosen):
            top_k = torch.tensor([max(p.top_k, 0) for p in chosen], device=device)
            top_p = torch.tensor([p.top_p for p in chosen], device=device, dtype=x.dtype)
            x = _filter_top_k_top_p(x, top_k, top_p)
        cdf = x.softmax(dim=-1).cumsum(dim=-1)
        draws = []
        for i in rows:
            generator = generators[i] if i < len(generators) and generators[i] is not None else self._shared
            draws.append(float(torch.rand((), generator=generator)))
        u = torch.tensor(draws, device=device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)
        # Round-off can put u at or past the last step; walk back to the last token with mass.
        tokens = torch.minimum(tokens, _last_nonzero(x))
        return [int(t) for t in tokens.tolist()]


def _last_nonzero(logits: torch.Tensor) -> torch.Tensor:
    """Index of the last finite logit per row."""
    vocab = logits.shape[-1]
    finite = torch.isfinite(logits)
    ranks = torch.arange(vocab, device=logits.device).expand_as(logits)
    return torch.where(finite, ranks, -1).max(dim=-1).values
