"""`Sampler`: one batch of logits rows, each row sampled with its request's `SamplingParams`
(`contbatch.loop.params`).

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

from collections.abc import Sequence

import torch

from contbatch.loop.params import SamplingParams


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
