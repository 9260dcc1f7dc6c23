"""The engine on each device: the same checks on the CPU and, under the `cuda` marker, on CUDA.

Every test takes the `device` fixture (or the `PRECISIONS` parametrization), so its body runs on
the CPU in every test run and on a GPU only when torch sees one (`pytest -m cuda`, which
benchmarks/gpu_check.sh runs). On each device, against transformers on the same device:

- the model forward over paged KV (prefill chunks and decodes of two requests in one batch) gives
  transformers' logits: to 1e-4 in float32; in bfloat16 and float16 (CUDA only) no further from a
  float64 reference than three times transformers' own error in that dtype (float32: twice);
- greedy tokens equal transformers' `generate`: exactly in float32; in half precision up to the
  first position where transformers' own top two logits are closer than twice the two models' summed
  error (a near-tie, where either answer is right);
- `LLMEngine` with `EngineConfig(device=...)` equals `generate` under chunked prefill and under
  preemption by swap (host copies pinned on CUDA);
- the paged KV cache, every sampling rule and log-probabilities run there (seeded draws give the
  CPU's tokens: the generators live on the CPU);
- `ModelRunner.execute` returns only once the step's device work is done (host-clock step times
  are honest) and the model, its KV cache and the runner name one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from engine.conftest import CUDA, build_hf_checkpoint, random_prompt

from contbatch.core import FinishReason, SchedulerConfig
from contbatch.core.config import KVConfig
from contbatch.core.outputs import LogprobsResult, ScheduledChunk, build_output
from contbatch.engine import runner as runner_module
from contbatch.engine.demo import train_tokenizer, write_tokenizer
from contbatch.engine.device import resolve_device
from contbatch.engine.kv_cache import PagedKVCache, bytes_per_block
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.engine.load import warm_up
from contbatch.engine.loader import load_spec
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.loop.params import SamplingParams

ATOL_FP32 = 1e-4
BLOCK_SIZE = 4
NUM_NEW = 16
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)

_CUDA_MARKS = CUDA.marks
PRECISIONS = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cuda", torch.float32, id="cuda-float32", marks=_CUDA_MARKS),
    pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=_CUDA_MARKS),
    pytest.param("cuda", torch.float16, id="cuda-float16", marks=_CUDA_MARKS),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (vocabulary 211, GQA, untied) with a tokenizer, saved by transformers."""
    path = build_hf_checkpoint(tmp_path_factory.mktemp("device"), "llama", seed=3).path
    write_tokenizer(path, train_tokenizer(vocab_size=200, corpus=["a small corpus for a tiny tokenizer"] * 20))
    return path


_HF_MODELS: dict[tuple[Path, str, torch.dtype], Any] = {}


def _hf(path: Path, device: torch.device | str, dtype: torch.dtype) -> Any:
    """transformers' model of `path` on `device` in `dtype` (eval mode, EOS an ordinary token), cached."""
    key = (path, str(device), dtype)
    if key not in _HF_MODELS:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        model.generation_config.eos_token_id = None  # as the engine's ignore_eos
        _HF_MODELS[key] = model
    return _HF_MODELS[key]


def _hf_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len, vocab], float32 on the CPU, of one full forward."""
    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], device=model.device)
        return model(ids).logits[0].float().cpu()


def _hf_greedy(model: Any, prompt: Sequence[int], num_new: int = NUM_NEW) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([list(prompt)], device=model.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_new, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def _top2_gap(logits_row: torch.Tensor) -> float:
    top = logits_row.topk(2).values
    return float(top[0] - top[1])


def _assert_greedy_equal(got: Sequence[int], want: Sequence[int], model: Any, prompt: Sequence[int], tie: float) -> int:
    """`got` equals `want`, or differs first where transformers' top two logits are within `tie`
    (a near-tie: the rest is not comparable). Returns the number of equal leading tokens."""
    assert len(got) == len(want)
    for i, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        if ours != theirs:
            gap = _top2_gap(_hf_logits(model, [*prompt, *want[:i]])[-1])
            assert gap <= tie, f"token {i}: engine {ours}, transformers {theirs}, top-2 gap {gap:.3g} > {tie:.3g}"
            return i
    return len(got)


def _run_plans(
    runner: ModelRunner, tokens: dict[str, list[int]], plans: list[dict[str, tuple[int, int]]]
) -> dict[tuple[str, int], torch.Tensor]:
    """Run each plan {request: (start, n)} as one step; (request, position of the row) -> logits row (CPU)."""
    tables: dict[str, list[int]] = {}
    free = list(range(runner.kv_cache.num_blocks))[::-1]  # blocks handed out from the top: out of order
    for rid, t in tokens.items():
        need = -(-len(t) // BLOCK_SIZE)
        tables[rid], free = free[:need], free[need:]
    rows: dict[tuple[str, int], torch.Tensor] = {}
    for plan in plans:
        chunks = [ScheduledChunk(rid, s, n, n > 1, True) for rid, (s, n) in plan.items()]
        seqs = {rid: SequenceState(tokens[rid][: s + n], tables[rid]) for rid, (s, n) in plan.items()}
        ids, logits = runner.compute_logits(chunks, seqs)
        assert logits.device == runner.device
        for rid, row in zip(ids, logits.cpu(), strict=True):
            start, n = plan[rid]
            rows[rid, start + n - 1] = row
    return rows


# Request a (30 tokens) is prefilled in two chunks while b (17) prefills and then decodes beside it.
_PLANS: list[dict[str, tuple[int, int]]] = [
    {"b": (0, 9), "a": (0, 12)},
    {"b": (9, 1), "a": (12, 13)},
    *({"b": (10 + i, 1), "a": (25 + i, 1)} for i in range(5)),
    *({"b": (15 + i, 1)} for i in range(2)),
]


@pytest.mark.parametrize(("device_name", "dtype"), PRECISIONS)
def test_forward_and_greedy_match_transformers(checkpoint: Path, device_name: str, dtype: torch.dtype) -> None:
    device = torch.device(device_name)
    tokens = {"a": random_prompt(30, 211, seed=1), "b": random_prompt(17, 211, seed=2)}
    runner = ModelRunner.from_checkpoint(checkpoint, num_blocks=32, block_size=BLOCK_SIZE, device=device, dtype=dtype)
    assert (runner.model.dtype, runner.kv_cache.dtype, runner.device.type) == (dtype, dtype, device.type)
    ours = _run_plans(runner, tokens, _PLANS)
    assert len(ours) == 2 + 2 + 5 * 2 + 2

    theirs_model = _hf(checkpoint, device, dtype)
    truth_model = _hf(checkpoint, "cpu", torch.float64)
    theirs = {rid: _hf_logits(theirs_model, t) for rid, t in tokens.items()}
    truth = {rid: _hf_logits(truth_model, t) for rid, t in tokens.items()}
    err_ours = max(float((row - truth[rid][pos]).abs().max()) for (rid, pos), row in ours.items())
    err_theirs = max(float((theirs[rid][pos] - truth[rid][pos]).abs().max()) for rid, pos in ours)
    factor = 2 if dtype == torch.float32 else 3  # half precision: other matmul shapes (fused q/k/v), other rounding
    assert err_ours <= factor * err_theirs + 1e-5, (err_ours, err_theirs)
    if dtype == torch.float32:
        for (rid, pos), row in ours.items():
            torch.testing.assert_close(row, theirs[rid][pos], atol=ATOL_FP32, rtol=0, msg=f"{rid} at {pos}")

    # Greedy: the two requests decoded together by the engine loop, each against `generate` alone.
    memory = 64 * bytes_per_block(runner.spec, 16, dtype)
    name = str(dtype).removeprefix("torch.")
    engine = LLMEngine(EngineConfig(model=str(checkpoint), kv_cache_memory=memory, device=device_name, dtype=name))
    params = dataclasses.replace(GREEDY, max_tokens=NUM_NEW)
    requests = {rid: engine.add_request(t, params) for rid, t in tokens.items()}
    while engine.has_unfinished():
        engine.step()
    tie = 0.0 if dtype == torch.float32 else 2 * (err_ours + err_theirs)
    for rid, request in requests.items():
        want = _hf_greedy(theirs_model, tokens[rid])
        got = list(request.output_token_ids)
        if dtype == torch.float32:
            assert got == want, rid
        else:
            _assert_greedy_equal(got, want, theirs_model, tokens[rid], tie)
    assert len({t for r in requests.values() for t in r.output_token_ids}) > 5  # varied, not degenerate


def test_the_greedy_check_accepts_only_near_ties(checkpoint: Path) -> None:
    """The half-precision rule itself: a divergence passes only where the top two logits are within the tie."""
    model = _hf(checkpoint, "cpu", torch.float32)
    prompt = random_prompt(12, 211, seed=4)
    want = _hf_greedy(model, prompt, 4)
    assert _assert_greedy_equal(want, want, model, prompt, 0.0) == 4
    second = int(_hf_logits(model, [*prompt, want[0]])[-1].topk(2).indices[1])
    changed = [want[0], second, *want[2:]]
    gap = _top2_gap(_hf_logits(model, [*prompt, want[0]])[-1])
    assert _assert_greedy_equal(changed, want, model, prompt, gap) == 1
    with pytest.raises(AssertionError, match="top-2 gap"):
        _assert_greedy_equal(changed, want, model, prompt, gap / 2)


@pytest.mark.parametrize("preemption", ["none", "swap"])
def test_llm_engine_generate_equals_transformers_on_the_device(
    checkpoint: Path, device: torch.device, preemption: str
) -> None:
    """`EngineConfig(device=...)`, float32, a token budget below the prompts (chunked prefill), and a
    KV cache too small for all three requests at once (preemption by swap through host memory)."""
    prompts = [random_prompt(n, 211, seed=10 + n) for n in (5, 23, 40)]
    spec = load_spec(checkpoint)
    num_blocks = 64 if preemption == "none" else 7
    kv = KVConfig(preemption="swap", num_host_blocks=64, watermark=0.0)
    config = EngineConfig(
        model=str(checkpoint),
        device=str(device),
        dtype="float32",
        kv_cache_memory=num_blocks * bytes_per_block(spec, 16, torch.float32),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, kv=kv),
    )
    engine = LLMEngine(config)
    assert engine.runner.device == resolve_device(device) and engine.runner.kv_cache.num_blocks == num_blocks
    params = dataclasses.replace(GREEDY, max_tokens=NUM_NEW)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    model = _hf(checkpoint, device, torch.float32)
    for i, (prompt, request) in enumerate(zip(prompts, requests, strict=True)):
        assert request.finish_reason is FinishReason.LENGTH
        assert list(request.output_token_ids) == _hf_greedy(model, prompt), i
    stats = engine.scheduler.stats
    assert (stats.num_swap_outs > 0) == (preemption == "swap")
    assert engine.runner.kv_cache.swapped_ids == ()


def test_the_warm_up_leaves_no_trace(checkpoint: Path, device: torch.device) -> None:
    """`warm_up` (on CUDA when the engine loads; run here on every device) writes its steps' KV into
    blocks no request holds yet: the engine then serves as if it had not run."""
    spec = load_spec(checkpoint)
    config = EngineConfig(
        model=str(checkpoint),
        device=str(device),
        dtype="float32",
        kv_cache_memory=40 * bytes_per_block(spec, 16, torch.float32),
        scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, kv=KVConfig()),
    )
    engine = LLMEngine(config)
    cache = engine.runner.kv_cache.layer(0)[0]
    assert bool(cache.abs().sum() > 0) == (device.type == "cuda")  # the engine warmed up on CUDA only
    warm_up(engine.runner, engine.scheduler.config, devices=(device.type,))
    assert bool(cache.abs().sum() > 0)
    prompts = [random_prompt(n, 211, seed=30 + n) for n in (7, 30)]
    params = dataclasses.replace(GREEDY, max_tokens=NUM_NEW)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    model = _hf(checkpoint, device, torch.float32)
    for prompt, request in zip(prompts, requests, strict=True):
        assert list(request.output_token_ids) == _hf_greedy(model, prompt)


def test_paged_kv_cache_swaps_on_the_device(checkpoint: Path, device: torch.device) -> None:
    spec = load_spec(checkpoint)
    cache = PagedKVCache(spec, 8, BLOCK_SIZE, device=device)
    assert cache.device == resolve_device(device)
    key, value = cache.layer(1)
    assert key.device == cache.device and value.shape == (8, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    for i in range(spec.num_layers):  # distinct contents per layer, block and slot
        k, v = cache.layer(i)
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(i)).to(device))
        v.copy_(-k)
    before = [tuple(t[[3, 1]].cpu() for t in cache.layer(i)) for i in range(spec.num_layers)]
    cache.swap_out("r", [3, 1])
    host = cache._host["r"]
    assert host.device.type == "cpu" and host.is_pinned() == (cache.device.type == "cuda")
    for i in range(spec.num_layers):  # another request overwrites every block
        for t in cache.layer(i):
            t.zero_()
    cache.swap_in("r", [6, 0])
    for i in range(spec.num_layers):
        for got, want in zip(cache.layer(i), before[i], strict=True):
            assert torch.equal(got[[6, 0]].cpu(), want)
    assert cache.swapped_ids == ()
    with pytest.raises(ValueError, match="out of range"):
        cache.swap_out("r", [8])


def test_every_sampling_rule_runs_on_the_device(checkpoint: Path, device: torch.device) -> None:
    """Penalties, bias, min_p, top-k, top-p, seeded and shared draws, log-probabilities and a
    speculative verification chunk: the device's tokens are the CPU's, its log-probabilities
    transformers' log-softmax to 1e-4."""
    rules = {
        "seeded": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, logprobs=3),
        "shared": SamplingParams(temperature=1.2, min_p=0.05),
        "penalised": SamplingParams(
            temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, logit_bias=((5, 3.0),)
        ),
        "prompt": SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=1),
        "verify": SamplingParams(temperature=0.0),
    }
    prompts = {rid: random_prompt(6 + 3 * i, 211, seed=20 + i) for i, rid in enumerate(rules)}

    def run(dev: torch.device | str) -> tuple[list[dict[str, tuple[int, ...]]], list[Any]]:
        runner = ModelRunner.from_checkpoint(checkpoint, num_blocks=48, block_size=BLOCK_SIZE, device=dev, seed=5)
        tables = {rid: list(range(8 * i, 8 * i + 8)) for i, rid in enumerate(rules)}
        tokens = {rid: list(p) for rid, p in prompts.items()}
        drafts: list[int] = []
        chunks = [ScheduledChunk(rid, 0, len(p), True, True) for rid, p in prompts.items()]
        sampled, results = [], []
        for step in range(3):
            seqs = {rid: SequenceState(tokens[rid], tables[rid], rules[rid], len(prompts[rid])) for rid in rules}
            seqs["verify"] = dataclasses.replace(seqs["verify"], token_ids=tokens["verify"] + drafts)
            result = runner.execute(build_output(step, chunks), seqs, prompt_logprob_ids={"prompt"})
            sampled.append(dict(result.sampled_token_ids))
            results.append(result)
            for rid, new in result.sampled_token_ids.items():
                tokens[rid].extend(new)
            chunks = [ScheduledChunk(rid, len(tokens[rid]) - 1, 1, False, True) for rid in rules if rid != "verify"]
            # "verify": its newest token and two drafts (the greedy continuation, then token 0)
            drafts = [_hf_greedy(_hf(checkpoint, "cpu", torch.float32), tokens["verify"], 1)[0], 0]
            chunks.append(ScheduledChunk("verify", len(tokens["verify"]) - 1, 3, False, True))
        return sampled, results

    on_cpu, _ = run("cpu")
    on_device, results = run(device)
    assert on_device == on_cpu
    assert len(on_device[1]["verify"]) >= 2  # the first draft is the greedy token: accepted
    hf = _hf(checkpoint, "cpu", torch.float32)
    first = results[0]
    assert isinstance(first, LogprobsResult) and first.logprobs is not None and first.prompt_logprobs is not None
    reference = _hf_logits(hf, [*prompts["seeded"], *on_device[0]["seeded"]]).log_softmax(-1)
    entry = first.logprobs["seeded"][0]
    assert entry.token_id == on_device[0]["seeded"][0] and len(entry.top) == 3
    assert abs(entry.logprob - float(reference[len(prompts["seeded"]) - 1, entry.token_id])) < 1e-4
    prompt_entries = first.prompt_logprobs["prompt"]
    reference = _hf_logits(hf, prompts["prompt"]).log_softmax(-1)
    assert prompt_entries[0] is None and len(prompt_entries) == len(prompts["prompt"])
    for pos, e in enumerate(prompt_entries[1:]):
        assert e is not None and e.token_id == prompts["prompt"][pos + 1]
        assert abs(e.logprob - float(reference[pos, e.token_id])) < 1e-4


def test_a_step_returns_after_its_device_work(
    checkpoint: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that samples nothing (a prefill chunk) reads nothing back from the device: `execute`
    synchronizes it anyway, so timing it with a host clock (the loop, calibration) is honest."""
    runner = ModelRunner.from_checkpoint(checkpoint, num_blocks=16, block_size=BLOCK_SIZE, device=device)
    calls: list[torch.device] = []
    synchronize = runner_module.synchronize
    monkeypatch.setattr(runner_module, "synchronize", lambda dev: (calls.append(dev), synchronize(dev)))
    prompt = random_prompt(40, 211, seed=30)
    seq = {"r": SequenceState(prompt, list(range(10)))}
    result = runner.execute(build_output(0, [ScheduledChunk("r", 0, 40, True, False)]), seq)
    assert result.sampled_token_ids == {} and calls == [runner.device]
    if runner.device.type == "cuda":
        assert torch.cuda.current_stream(runner.device).query()  # nothing left queued
    key, _ = runner.kv_cache.layer(0)
    assert bool(key[:10].abs().sum() > 0)  # the chunk's keys were written
    runner.execute(build_output(1, [ScheduledChunk("r", 0, 40, True, True)]), seq)
    assert calls == [runner.device] * 2


def test_the_model_its_cache_and_the_runner_name_one_device(checkpoint: Path, device: torch.device) -> None:
    """A bare "cuda" names the current CUDA device, as the tensors made there report it; the
    default dtype is float32 on the CPU and the checkpoint's (float32 here) on CUDA."""
    runner = ModelRunner.from_checkpoint(checkpoint, num_blocks=4, block_size=BLOCK_SIZE, device=str(device.type))
    want = resolve_device(device.type)
    assert want.index is not None if want.type == "cuda" else want == torch.device("cpu")
    assert runner.device == runner.model.device == runner.kv_cache.device == want
    assert runner.model.embed.device == runner.kv_cache.layer(0)[0].device == want
    assert runner.model.dtype == torch.float32
    rebuilt = ModelRunner(runner.spec, runner.model, PagedKVCache(runner.spec, 4, BLOCK_SIZE, device=want))
    assert rebuilt.device == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_is_refused_on_the_cpu(checkpoint: Path, dtype: str) -> None:
    with pytest.raises(ValueError, match="CUDA-only"):
        ModelRunner.from_checkpoint(checkpoint, num_blocks=4, device="cpu", dtype=dtype)


@pytest.mark.parametrize(
    ("name", "message"),
    [("tpu", "unknown device 'tpu'"), ("meta", "not supported"), ("cuda:99", "cuda:99")],
)
def test_a_device_the_engine_cannot_use_is_a_clear_error(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_device(name)


@pytest.mark.parametrize("name", ["cuda", "cpu"])
def test_attention_on_cuda_uses_only_kernels_built_ahead(name: str) -> None:
    """cuDNN's scaled-dot-product attention plans each new shape (9.5 s against 0.48 s for a
    bfloat16 run on new shapes, `benchmarks/results/gpu_dtypes_h200.json`): a forward pass on CUDA
    runs without it, the other backends on; on the CPU nothing changes; the flags are restored."""
    from contbatch.engine.attention import attention_kernels

    flags = (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
             torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)  # fmt: skip
    before = [f() for f in flags]
    with attention_kernels(torch.device(name)):
        inside = [f() for f in flags]
    assert inside == ([False, True, True, True] if name == "cuda" else before)
    assert [f() for f in flags] == before
