"""SamplingParams validation, greedy, top-k/top-p filtering, and reproducible seeded sampling."""

from __future__ import annotations

import pytest
import torch

from contbatch.engine.sampling import Sampler, greedy_tokens, reads_known_argmax
from contbatch.loop.params import GREEDY, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_params_and_normalisation() -> None:
    p = SamplingParams(temperature=0, top_k=0, top_p=1, stop="END", stop_token_ids=[3, 4], max_tokens=None)
    assert p.greedy and p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert SamplingParams(top_k=-1).top_k == -1 and not SamplingParams().greedy
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits()
    assert Sampler().sample(logits, [GREEDY] * 4) == logits.argmax(-1).tolist()


def test_greedy_tokens_follow_argmax_on_ties_nan_and_inf() -> None:
    """The greedy token is `torch.argmax`'s: the first maximum on ties, a NaN counts as the maximum."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (24, 32_000), generator=g).float()  # many ties per row
    logits[3, 17] = float("nan")
    logits[5, [2, 31_999]] = float("nan")
    logits[7] = float("-inf")
    logits[9, 31_999] = float("inf")
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits)[3] == 17 and greedy_tokens(logits)[7] == 0 and greedy_tokens(logits)[9] == 31_999


def test_a_known_argmax_is_used_unless_a_row_adjusts_its_logits() -> None:
    """`prepare(greedy=...)` (the LM head's product found each row's argmax) spares the sampler its
    own pass; a row with a logit bias or penalties makes it compute the argmax of what it adjusted."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    said = torch.tensor([2, 2])  # not the argmax: shows which one is used
    assert Sampler().prepare(logits, [GREEDY, GREEDY], greedy=said).draw([0, 1]) == [2, 2]
    biased = SamplingParams(temperature=0.0, logit_bias={0: 5.0})
    assert Sampler().prepare(logits, [GREEDY, biased], greedy=said).draw([0, 1]) == [1, 0]
    assert Sampler().prepare(logits, [GREEDY, GREEDY]).draw([0, 1]) == [1, 0]


def test_the_runner_asks_for_the_argmax_only_where_the_sampler_reads_it() -> None:
    """`reads_known_argmax`: some row greedy, none adjusting its logits (the runner then has the LM
    head's product find it; all-random or adjusted batches skip that scan)."""
    random_row = SamplingParams(temperature=0.8)
    biased = SamplingParams(temperature=0.0, logit_bias={0: 5.0})
    assert reads_known_argmax([GREEDY, random_row])
    assert not reads_known_argmax([random_row, random_row])
    assert not reads_known_argmax([GREEDY, biased])
    assert not reads_known_argmax([])


@pytest.mark.parametrize("vocab", [1, 7, 256, 257, 1000, 32_001])
def test_greedy_tokens_match_argmax_for_any_vocabulary_size(vocab: int) -> None:
    """Two-pass greedy (span maxima, then the winning span) on vocabularies shorter than a span,
    a whole number of spans and a short last span; a row's maximum or NaN in that short span."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 3, (6, vocab), generator=g).float()
    logits[1, -1] = 5.0
    logits[2, -1] = float("nan")
    logits[3, vocab // 2] = float("nan")
    logits[4] = float("-inf")
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits[:0]) == []


def test_top_k_one_and_tiny_top_p_are_argmax() -> None:
    logits = _logits()
    sampler = Sampler(seed=3)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=5.0, top_k=1)):
        for _ in range(5):
            assert sampler.sample(logits, [params] * 4) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = _logits(rows=1, vocab=20)
    order = logits[0].argsort(descending=True).tolist()
    probs = logits[0].softmax(-1)[order]
    sampler = Sampler(seed=1)
    seen_k = {sampler.sample(logits, [SamplingParams(top_k=3)])[0] for _ in range(300)}
    assert seen_k <= set(order[:3]) and len(seen_k) > 1
    cut = int((probs.cumsum(0) < 0.6).sum()) + 1  # smallest prefix whose mass reaches 0.6
    seen_p = {sampler.sample(logits, [SamplingParams(top_p=0.6)])[0] for _ in range(300)}
    assert seen_p <= set(order[:cut])


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    sampler = Sampler(seed=0)
    counts = torch.bincount(
        torch.tensor([sampler.sample(logits, [SamplingParams()])[0] for _ in range(3000)]), minlength=3
    )
    torch.testing.assert_close(counts.float() / 3000, logits.softmax(-1)[0], atol=0.04, rtol=0)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    logits = _logits(rows=3)
    seeded = SamplingParams(seed=1234)

    def draw(sampler_seed: int, others: int) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        generator = torch.Generator(device="cpu").manual_seed(1234)
        out = []
        for _ in range(20):
            params = [SamplingParams()] * others + [seeded]
            rows = torch.cat([logits[1:].repeat(others, 1)[:others], logits[:1]])
            out.append(sampler.sample(rows, params, [None] * others + [generator])[-1])
        return out

    assert draw(0, 0) == draw(99, 2) == draw(5, 1)
    assert len(set(draw(0, 0))) > 1
    other = SamplingParams(seed=999)
    assert draw(0, 0) != [
        Sampler(seed=0).sample(logits[:1], [other], [torch.Generator(device="cpu").manual_seed(999)])[0]
        for _ in range(20)
    ]


def test_unseeded_sampling_reproducible_from_the_sampler_seed() -> None:
    logits = _logits(rows=4)
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 4
    a = [Sampler(seed=7).sample(logits, params) for _ in range(1)]
    b = [Sampler(seed=7).sample(logits, params) for _ in range(1)]
    assert a == b


def test_mixed_greedy_and_random_rows() -> None:
    logits = _logits(rows=4)
    params = [GREEDY, SamplingParams(top_k=1), GREEDY, SamplingParams(temperature=0.5, top_k=1)]
    assert Sampler().sample(logits, params) == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(logits, params[:2])
