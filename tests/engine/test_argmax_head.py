"""The greedy argmax from the LM head in bfloat16 (`contbatch.engine.argmax_head`) is the float32
panel product's, exactly, by each kernel that runs here (AVX-512's vectors, AMX's tiles): random
heads, ties and near-ties, rows left to float32, whole decodes."""

from __future__ import annotations

import threading

import pytest
import torch

from contbatch.engine import native
from contbatch.engine.argmax_head import ArgmaxHead, bound_for

pytestmark = pytest.mark.skipif(not native.argmax_bf16_kernels(), reason="the kernels' AVX-512 build only")


@pytest.fixture(params=list(native.BF16_ARGMAX_KERNELS))
def kernel(request: pytest.FixtureRequest) -> str:
    if request.param not in native.argmax_bf16_kernels():
        pytest.skip(f"the {request.param} kernel does not run on this CPU")
    return str(request.param)


def float32_argmax(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.empty(h.shape[0], dtype=torch.long)
    native.panel_product(h, native.pack_panels(w), argmax=out)
    return out


def bf16_argmax(h: torch.Tensor, w: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    head = ArgmaxHead.build(w, native.pack_panels(w), kernel)
    assert head is not None and head.kernel == kernel
    out = torch.empty(h.shape[0], dtype=torch.long)
    left = head.argmax(h, out)
    return out, left


@pytest.mark.parametrize(
    ("rows", "vocab", "width"), [(1, 64, 16), (5, 2048, 384), (14, 96, 40), (32, 2048, 384), (45, 512, 64)]
)
def test_the_argmax_is_float32s_on_random_heads(rows: int, vocab: int, width: int, kernel: str) -> None:
    generator = torch.Generator().manual_seed(rows * vocab + width)
    w = torch.randn(vocab, width, generator=generator) * 0.05
    h = torch.randn(rows, width, generator=generator)
    got, left = bf16_argmax(h, w, kernel)
    assert left.numel() == 0
    assert torch.equal(got, float32_argmax(h, w))


def test_it_runs_on_a_thread_other_than_the_one_that_built_it(kernel: str) -> None:
    """The server's engine steps on its driver thread, after loading on another: AMX's tile state
    is granted to the whole process (a thread without it would die on its first tile instruction)."""
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(512, 384, generator=generator) * 0.05
    h = torch.randn(32, 384, generator=generator)
    head = ArgmaxHead.build(w, native.pack_panels(w), kernel)
    assert head is not None
    out = torch.empty(32, dtype=torch.long)
    worker = threading.Thread(target=head.argmax, args=(h, out))
    worker.start()
    worker.join()
    assert torch.equal(out, float32_argmax(h, w))


def test_ties_and_near_ties_go_as_float32_goes(kernel: str) -> None:
    """Columns equal in bfloat16 but not in float32, and exact copies (the first column wins)."""
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(256, 64, generator=generator) * 0.05
    w[40] = w[10]  # an exact tie: 10 comes first
    w[70] = w[10] * (1 + 2e-7)  # above 10 by less than bfloat16 can tell
    w[90] = w[20] * (1 - 2e-7)  # below 20 by as little
    w[91] = w[20]
    h = torch.stack([w[10] * 9, w[20] * 9, -w[10] * 9, torch.randn(64, generator=generator)])
    got, left = bf16_argmax(h, w, kernel)
    assert left.numel() == 0
    assert torch.equal(got, float32_argmax(h, w))
    assert got[:2].tolist() == float32_argmax(h, w)[:2].tolist()


def test_a_cluster_bfloat16_reorders_is_decided_in_float32(kernel: str) -> None:
    """Twenty columns within 0.1 % of one another, closer than bfloat16's rounding (0.4 %): the
    rounding reorders them, so the bound must keep every one that could win."""
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=generator) * 0.05
    base = w[0].clone()
    w[:20] = base * (1 + 1e-3 * torch.randn(20, 1, generator=generator)) + 1e-4 * torch.randn(
        20, 384, generator=generator
    )
    h = base * 20 + 0.3 * torch.randn(64, 384, generator=generator)
    approx = h @ w.bfloat16().float().T
    got, left = bf16_argmax(h, w, kernel)
    assert left.numel() == 0
    assert torch.equal(got, float32_argmax(h, w))
    assert (approx.argmax(1) != float32_argmax(h, w)).any()  # (bfloat16 alone would pick wrong)


def test_logits_equal_but_for_rounding_are_summed_as_the_panel_product_sums_them(kernel: str) -> None:
    """Eight columns that are permutations of one another against rows of equal elements: their
    exact logits are equal, and only the float32 sums' rounding (k in order, fused) tells them
    apart. The candidates' sums must round as the panel product's do, bit for bit."""
    generator = torch.Generator().manual_seed(11)
    w = torch.randn(128, 384, generator=generator) * 0.01
    base = torch.randn(384, generator=generator)
    for i in range(8):
        w[i] = base[torch.randperm(384, generator=generator)]
    h = torch.rand(64, 1, generator=generator).add(0.5).expand(64, 384).contiguous()
    want = float32_argmax(h, w)
    assert len(set(want.tolist())) > 1  # (the rounding picks different columns in different rows)
    got, left = bf16_argmax(h, w, kernel)
    assert left.numel() == 0
    assert torch.equal(got, want)


def test_rows_it_cannot_decide_are_left_to_float32(kernel: str) -> None:
    """A row whose candidates overflow (every column the same) or whose h is not finite is -1."""
    w = torch.ones(128, 16)
    h = torch.ones(3, 16)
    h[1, 0] = float("nan")
    h[2, 3] = float("inf")
    got, left = bf16_argmax(h, w, kernel)
    assert got.tolist() == [-1, -1, -1] and left.tolist() == [0, 1, 2]


def test_a_head_it_cannot_bound_is_not_built(kernel: str) -> None:
    w = torch.randn(64, 16)
    assert ArgmaxHead.build(w[:48].contiguous(), native.pack_panels(w[:48].contiguous()), kernel) is None  # 48 rows
    w[3, 3] = float("inf")
    assert ArgmaxHead.build(w, native.pack_panels(w), kernel) is None
    assert 0.0039 < bound_for(384) < 0.0041
    assert 0.0079 < bound_for(384, rounded_operands=2) < 0.0081


def test_a_greedy_decode_takes_the_same_tokens_with_and_without_it(kernel: str) -> None:
    """The engine's greedy tokens with the bfloat16 head equal those of the float32 product; a
    request that asks for log-probabilities keeps the float32 path (its logits are read)."""
    from contbatch.engine.llm_engine import EngineConfig, LLMEngine
    from contbatch.loop.params import SamplingParams

    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 1024**2))
    model = engine.runner.model
    assert model.argmax_only_head
    model.argmax_head = ArgmaxHead.build(model.argmax_head.rows32, model.lm_head_t, kernel)
    prompts = ["The quick brown fox", "Once upon a time there", "def main():\n    return", "1, 2, 3, 4,"]

    def decode(tag: str, logprobs: int | None = None) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=logprobs if i == 0 else None)
            engine.add_request(prompt, params, request_id=f"{tag}{i}")
        while engine.has_unfinished():
            for output in engine.step():
                tokens.setdefault(output.request_id[len(tag) :], []).extend(output.token_ids)
        return tokens

    with_head = decode("a")
    mixed = decode("b", logprobs=2)
    head, model.argmax_head = model.argmax_head, None
    try:
        without = decode("c")
    finally:
        model.argmax_head = head
    assert with_head == without == mixed
