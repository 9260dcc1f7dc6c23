"""`Sampler`: one batch of logits rows, each row sampled with its request's `SamplingParams`
(`contbatch.loop.params`), and the log-probabilities the requests ask for.

Rules (vLLM's v1 sampler; `contbatch.loop.params` states each one), per row, in order:
logit_bias, then the repetition / frequency / presence penalties (they need the row's history:
the prompt and the output tokens before the row's token), then greedy (argmax of the row so
far) or temperature, min_p, top-k, top-p and a draw.

- A request with a `seed` draws from its own `torch.Generator`, so its tokens do not depend on
  what else is in the batch; requests without one share the sampler's seeded generator.
- A random row consumes exactly one uniform draw from its generator when it is drawn, and none
  before: `prepare` computes every row's distribution at once, `Prepared.draw` draws the rows
  asked for. Speculative verification draws a request's rows one at a time and stops at the
  first rejected draft, so a seeded request consumes one draw per output token, as without
  speculation.
- Log-probabilities (`logprobs_of`) are those of the raw model distribution: log-softmax of the
  logits as the model gave them, before any rule (vLLM's default, ``raw_logprobs``).

Invariant: every sampled id is in [0, vocab) and has a nonzero probability after the filters
(the most likely token always survives min_p, top-k and top-p).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contbatch.core.outputs import TokenLogprobs
from contbatch.loop.params import SamplingParams


@dataclass(frozen=True, slots=True)
class History:
    """What the penalties of one row look at: the request's prompt token ids and the output
    token ids before the row's token."""

    prompt: Sequence[int]
    output: Sequence[int]


_NO_HISTORY = History((), ())


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of `logits` with everything outside top-k / top-p set to -inf; top_k 0 means all."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; the most likely token
    # always stays (a top_p that rounds to 0 in float32 must not empty the row).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p: drop tokens whose probability is below min_p x the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_penalties(row: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """One row [vocab] with `params`' penalties applied (vLLM's `apply_penalties`): repetition
    over prompt and output tokens, frequency and presence over output tokens."""
    vocab = row.shape[-1]
    device = row.device
    output = torch.tensor(list(history.output), dtype=torch.long, device=device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
    in_output = counts > 0
    if params.repetition_penalty != 1:
        seen = in_output.clone()
        if len(history.prompt):
            seen[torch.tensor(list(history.prompt), dtype=torch.long, device=device)] = True
        penalty = params.repetition_penalty
        penalized = torch.where(row > 0, row / penalty, row * penalty)
        row = torch.where(seen, penalized, row)
    if params.frequency_penalty != 0:
        row = row - params.frequency_penalty * counts
    if params.presence_penalty != 0:
        row = row - params.presence_penalty * in_output.to(row.dtype)
    return row


def apply_logit_bias(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    vocab = row.shape[-1]
    pairs = [(t, b) for t, b in params.logit_bias if t < vocab]  # the intake refuses ids beyond the vocabulary
    if not pairs:
        return row
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=row.device)
    bias = torch.tensor([b for _, b in pairs], dtype=row.dtype, device=row.device)
    return row.index_add(0, ids, bias)


class Prepared:
    """Every row's distribution, ready to draw from (see `Sampler.prepare`)."""

    def __init__(
        self,
        sampler: Sampler,
        *,
        adjusted: torch.Tensor,
        params: Sequence[SamplingParams],
        cdf: torch.Tensor | None,
        last: torch.Tensor | None,
        random_index: dict[int, int],
        greedy: list[int] | None = None,
    ) -> None:
        self._sampler = sampler
        self.adjusted = adjusted  # [R, vocab] float32: the logits after bias and penalties
        self.params = params
        self._cdf = cdf  # [random rows, vocab] cumulative probabilities (unnormalised)
        self._last = last  # [random rows] last token with mass
        self._random_index = random_index  # row -> its index in cdf
        self._greedy = greedy  # every row's argmax of `adjusted`, once known

    def greedy_token(self, row: int) -> int:
        """The row's most likely token (the first one on ties, as `argmax`), computed for every row at once."""
        if self._greedy is None:
            self._greedy = greedy_tokens(self.adjusted)
        return self._greedy[row]

    def draw(self, rows: Sequence[int], generators: Sequence[torch.Generator | None] = ()) -> list[int]:
        """A token for each of `rows`; `generators[j]` (None: the shared one) draws rows[j]."""
        result = [0] * len(rows)
        random_at: list[int] = []
        draws: list[float] = []
        for j, row in enumerate(rows):
            if row not in self._random_index:
                result[j] = self.greedy_token(row)
                continue
            generator = generators[j] if j < len(generators) else None
            random_at.append(j)
            draws.append(float(torch.rand((), generator=generator or self._sampler.shared)))
        if random_at:
            assert self._cdf is not None and self._last is not None
            at = torch.tensor([self._random_index[rows[j]] for j in random_at], device=self._cdf.device)
            cdf = self._cdf.index_select(0, at)
            u = torch.tensor(draws, device=cdf.device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)
            # Round-off can put u at or past the last step; walk back to the last token with mass.
            tokens = torch.minimum(tokens, self._last.index_select(0, at))
            for j, token in zip(random_at, tokens.tolist(), strict=True):
                result[j] = int(token)
        return result


class Sampler:
    """Samples one token per logits row, each row with its own `SamplingParams` and generator."""

    def __init__(self, seed: int = 0) -> None:
        self.shared = torch.Generator(device="cpu").manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] = (),
        histories: Sequence[History] = (),
    ) -> list[int]:
        """Token ids for `logits` [R, vocab]; `generators[i]` (None: the shared one) draws row i;
        `histories[i]` is row i's history (needed with penalties only)."""
        prepared = self.prepare(logits, params, histories)
        return prepared.draw(range(logits.shape[0]), generators)

    def prepare(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[History] = (),
        *,
        greedy: torch.Tensor | None = None,
    ) -> Prepared:
        """Each row's distribution under its params (no draw yet). `greedy`: each row's argmax of
        `logits` when already known (`torch.argmax`'s rules; kept unless a row adjusts its logits)."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logits rows but {len(params)} sampling params")
        x = logits.float()
        adjust = [i for i, p in enumerate(params) if p.adjusts_logits]
        known = greedy.tolist() if greedy is not None and reads_known_argmax(params) else None
        if adjust:
            x = x.clone()
            for i in adjust:
                p = params[i]
                row = apply_logit_bias(x[i], p) if p.logit_bias else x[i]
                if p.has_penalties:
                    row = apply_penalties(row, p, histories[i] if i < len(histories) else _NO_HISTORY)
                x[i] = row
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return Prepared(self, adjusted=x, params=params, cdf=None, last=None, random_index={}, greedy=known)
        cdf, last = self._distribution(x, random_rows, params)
        index = {row: j for j, row in enumerate(random_rows)}
        return Prepared(self, adjusted=x, params=params, cdf=cdf, last=last, random_index=index, greedy=known)

    def _distribution(
        self, x: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = x.device
        chosen = [params[i] for i in rows]
        y = x[rows] / torch.tensor([p.temperature for p in chosen], device=device)[:, None]
        if any(p.min_p > 0 for p in chosen):
            y = _filter_min_p(y, torch.tensor([p.min_p for p in chosen], device=device, dtype=y.dtype))
        if any(p.top_k > 0 or p.top_p < 1 for p in chosen):
            top_k = torch.tensor([max(p.top_k, 0) for p in chosen], device=device)
            top_p = torch.tensor([p.top_p for p in chosen], device=device, dtype=y.dtype)
            y = _filter_top_k_top_p(y, top_k, top_p)
        return y.softmax(dim=-1).cumsum(dim=-1), _last_nonzero(y)


_GREEDY_SPAN = 256  # vocabulary entries per span of `greedy_tokens`' first pass


def reads_known_argmax(params: Sequence[SamplingParams]) -> bool:
    """Whether `Sampler.prepare` reads a known argmax (`greedy`) for rows of `params`: some row is
    greedy and no row adjusts its logits (the argmax is of the logits as they came)."""
    return any(p.greedy for p in params) and not any(p.adjusts_logits for p in params)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of `logits` [R, vocab]: the first maximum on ties, NaN counting as
    the maximum (`torch.argmax`'s rules), in two passes. A value-only maximum of every span of
    `_GREEDY_SPAN` entries (`amax`, vectorised) finds each row's first span holding its maximum
    (or its first NaN), then `max(dim)` with indices runs over that span only: on CPU about 5x
    faster than `max(dim)` over whole rows, itself 2-3x faster than `argmax` (for 32 x 32,000
    float32 rows, one thread: about 0.2 ms against 1.0 ms and 1.2 ms)."""
    rows, vocab = logits.shape
    full = vocab // _GREEDY_SPAN * _GREEDY_SPAN
    maxima = logits[:, :full].reshape(rows, full // _GREEDY_SPAN, _GREEDY_SPAN).amax(dim=-1)
    if full < vocab:
        maxima = torch.cat((maxima, logits[:, full:].amax(dim=-1, keepdim=True)), dim=1)
    start = maxima.max(dim=-1).indices * _GREEDY_SPAN
    # The last span may be short: its index runs past the row are clamped to the row's last
    # entry, copies after the original, which the first-maximum rule never picks.
    index = (start[:, None] + torch.arange(_GREEDY_SPAN, device=logits.device)).clamp_(max=vocab - 1)
    return (start + logits.gather(1, index).max(dim=-1).indices).tolist()


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """For each row of `logits` [R, vocab] (raw): the log-probability of `token_ids[i]`, its
    rank (1 = most likely) and the `num_top[i]` most likely (id, log-probability), in float32
    log-softmax (vLLM's raw logprobs). -inf is reported as -9999.0 (JSON has no infinity)."""
    if not len(token_ids):
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    k = max(num_top)
    top_values, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    chosen_list = chosen.squeeze(1).clamp(min=-9999.0).tolist()
    top_values_list = top_values.clamp(min=-9999.0).tolist()
    top_ids_list = top_ids.tolist()
    out = []
    for i, (token, rank) in enumerate(zip(token_ids, ranks.tolist(), strict=True)):
        n = num_top[i]
        top = tuple(zip(top_ids_list[i][:n], top_values_list[i][:n], strict=True))
        out.append(TokenLogprobs(int(token), chosen_list[i], int(rank), top))
    return out


def _last_nonzero(logits: torch.Tensor) -> torch.Tensor:
    """Index of the last finite logit per row."""
    vocab = logits.shape[-1]
    finite = torch.isfinite(logits)
    ranks = torch.arange(vocab, device=logits.device).expand_as(logits)
    return torch.where(finite, ranks, -1).max(dim=-1).values
