"""The sampler's logits processing on hand-made logits, rule by rule as vLLM applies them
(`contbatch.loop.params`): logit_bias, then repetition / frequency / presence penalties, then
greedy or temperature, min_p, top-k, top-p; raw log-probabilities; the new parameters'
validation; poison values that round to 0 in float32."""

from __future__ import annotations

import math

import pytest
import torch

from contbatch.engine.sampling import History, Sampler, logprobs_of
from contbatch.loop.params import GREEDY, SamplingParams

VOCAB = 8


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def adjusted(logits: torch.Tensor, params: SamplingParams, history: History | None = None) -> list[float]:
    prepared = Sampler().prepare(logits, [params], [history] if history is not None else ())
    return [round(v, 6) for v in prepared.adjusted[0].tolist()]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-46}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logit_bias": 5}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_bad_new_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_new_params_normalise() -> None:
    p = SamplingParams(logit_bias={5: 1, 2: -3.5}, seed=2**64 - 1, logprobs=0, prompt_logprobs=20)
    assert p.logit_bias == ((2, -3.5), (5, 1.0))
    assert hash(p) == hash(
        SamplingParams(logit_bias=[(2, -3.5), (5, 1)], seed=2**64 - 1, logprobs=0, prompt_logprobs=20)
    )
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy


def test_logit_bias_is_added() -> None:
    logits = row(1, 2, 3, 4, 5, 6, 7, 8)
    assert adjusted(logits, SamplingParams(logit_bias={0: 100, 7: -2.5})) == [101, 2, 3, 4, 5, 6, 7, 5.5]
    # greedy follows the biased logits
    assert Sampler().sample(logits, [SamplingParams(temperature=0, logit_bias={0: 100})]) == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = row(2, -2, 2, -2, 4, 0, 1, -1)
    history = History(prompt=[0, 1], output=[4, 5, 4])
    # seen: 0, 1 (prompt) and 4, 5 (output); 0 stays 0
    assert adjusted(logits, SamplingParams(repetition_penalty=2.0), history) == [1, -4, 2, -2, 2, 0, 1, -1]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = row(0, 0, 0, 0, 0, 0, 0, 0)
    history = History(prompt=[1, 1, 2], output=[3, 3, 3, 5])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    assert adjusted(logits, p, history) == [0, 0, 0, -1.75, 0, -0.75, 0, 0]
    negative = SamplingParams(frequency_penalty=-1.0)  # negative values encourage repeats
    assert adjusted(logits, negative, history)[3] == 3


def test_bias_comes_before_the_penalties() -> None:
    # vLLM: logits -1, bias +2 = 1 (positive), then the repetition penalty divides: 0.5
    # (the other order would give -1 * 2 + 2 = 0)
    p = SamplingParams(logit_bias={0: 2.0}, repetition_penalty=2.0)
    assert adjusted(row(-1, 0, 0, 0, 0, 0, 0, 0), p, History(prompt=[0], output=[]))[0] == 0.5


def test_penalties_change_the_greedy_token() -> None:
    logits = row(5, 4.5, 0, 0, 0, 0, 0, 0)
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    assert Sampler().sample(logits, [p], histories=[History([], [])]) == [0]
    assert Sampler().sample(logits, [p], histories=[History([], [0])]) == [1]


def _support(logits: torch.Tensor, params: SamplingParams, draws: int = 400) -> set[int]:
    sampler = Sampler(seed=1)
    return {sampler.sample(logits, [params])[0] for _ in range(draws)}


def test_min_p_keeps_tokens_above_min_p_times_the_top_probability() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.03, 0.01, 0.005, 0.005])
    logits = probs.log()[None, :]
    # threshold 0.25 * 0.4 = 0.1: tokens 0..3 stay
    assert _support(logits, SamplingParams(min_p=0.25)) == {0, 1, 2, 3}
    # min_p applies after temperature: at temperature 0.5 probabilities ~ p^2, threshold 0.25 * top
    hot = (probs**2) / (probs**2).sum()
    keep = {i for i, q in enumerate(hot.tolist()) if q >= 0.25 * float(hot.max())}
    assert _support(logits, SamplingParams(temperature=0.5, min_p=0.25)) == keep == {0, 1}
    assert _support(logits, SamplingParams(min_p=1.0)) == {0}


def test_top_k_with_min_p_and_top_p() -> None:
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.03, 0.01, 0.005, 0.005]).log()[None, :]
    assert _support(logits, SamplingParams(top_k=2, min_p=0.1)) == {0, 1}
    assert _support(logits, SamplingParams(top_k=5, top_p=0.8)) == {0, 1, 2}


def test_poison_values_rounding_to_zero_stay_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=2)
    for params in (
        SamplingParams(top_p=1e-46),
        SamplingParams(temperature=1e-46),
        SamplingParams(top_p=1e-40, top_k=3),
    ):
        assert sampler.sample(logits, [params] * 3) == logits.argmax(-1).tolist()


def test_greedy_and_filtered_rows_draw_no_more_than_one_uniform_each() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(9)
    reference = torch.Generator().manual_seed(9)
    sampler = Sampler()
    params = [GREEDY, SamplingParams(seed=9), GREEDY, SamplingParams(seed=9, min_p=0.05)]
    prepared = sampler.prepare(logits, params)
    prepared.draw([0, 2], [generator, generator])  # greedy rows: no draw
    assert torch.equal(generator.get_state(), reference.get_state())
    prepared.draw([1, 3], [generator, generator])  # two random rows: two draws
    torch.rand((), generator=reference)
    torch.rand((), generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")], [0.0, 0.0, 5.0, 1.0]])
    got = logprobs_of(logits, [2, 3], [2, 0])
    want = torch.log_softmax(logits, dim=-1)
    assert got[0].token_id == 2 and got[0].rank == 2 and math.isclose(got[0].logprob, float(want[0, 2]), rel_tol=1e-6)
    assert [t for t, _ in got[0].top] == [1, 2]
    assert got[1].rank == 2 and got[1].top == ()
    assert logprobs_of(logits[:1], [3], [4])[0].logprob == -9999.0  # -inf is reported as -9999
