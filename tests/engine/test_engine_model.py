"""The engine's model agrees with transformers' forward to 1e-4 on float32 logits, for every supported
variant (GQA or not, tied or untied, RoPE scalings, Qwen2 biases, Mistral), whether a sequence is
prefilled at once, in chunks over a cached prefix, or decoded token by token."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from contbatch.core.outputs import ScheduledChunk
from contbatch.engine.attention import ChunkLayout, build_metadata
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.linear import onednn_packing
from contbatch.engine.loader import load_checkpoint
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.engine.spec import ARCHITECTURES

ATOL = 1e-4

VARIANTS: dict[str, tuple[str, dict]] = {
    "llama_gqa_untied": ("llama", {}),
    "llama_mha_tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama_head_dim": ("llama", {"head_dim": 24}),
    "rope_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}),
    "rope_llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            }
        },
    ),
    "rope_yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        },
    ),
    "rope_dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "qwen2_biases_tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
}


def test_every_registered_architecture_has_a_variant() -> None:
    assert {model_type for model_type, _ in VARIANTS.values()} == set(ARCHITECTURES)


def _runner(path, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
    spec, weights = load_checkpoint(path)
    return ModelRunner(spec, weights, PagedKVCache(spec, num_blocks, block_size))


def _run(runner: ModelRunner, tokens: Sequence[int], table: Sequence[int], spans: list[tuple[int, int]]) -> list:
    """Logits of the last token of each (start, n) chunk, run one chunk per step for request 'r'."""
    rows = []
    for start, n in spans:
        seq = SequenceState(tokens[: start + n], table)
        _, logits = runner.compute_logits([ScheduledChunk("r", start, n, n > 1, True)], {"r": seq})
        rows.append(logits[0])
    return rows


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The native kernels where they run (`contbatch.engine.native`), or every torch path in
    their place, weights in oneDNN's layout where torch has it (what CUDA, other dtypes, AVX-512
    CPUs and machines without a compiler run)."""
    if request.param == "torch":
        monkeypatch.setattr("contbatch.engine.attention.paged_decode", lambda *args, **kwargs: False)
        monkeypatch.setattr("contbatch.engine.model.add_rms_norm", lambda *args: None)
        monkeypatch.setattr("contbatch.engine.native.silu_mul", lambda *args: None)
        cpu_layout = "onednn" if onednn_packing(torch.device("cpu"), torch.float32) else "transposed"
        monkeypatch.setattr("contbatch.engine.linear.weight_layout", lambda *args: cpu_layout)
    return str(request.param)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.usefixtures("kernels")
def test_prefill_chunks_and_decodes_match_transformers(hf_checkpoint, variant: str) -> None:
    model_type, overrides = VARIANTS[variant]
    ckpt = hf_checkpoint(model_type, **overrides)
    tokens = torch.randint(0, 211, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = ckpt.logits(tokens)
    table = [7, 3, 11, 0, 5, 9, 2, 8, 14, 1]  # 10 blocks of 4 tokens, out of order

    runner = _runner(ckpt.path)
    assert runner.spec.rope.rope_type == overrides.get("rope_parameters", {}).get("rope_type", "default")
    whole = _run(runner, tokens[:30], table, [(0, 30)])
    torch.testing.assert_close(whole[0], ref[29], atol=ATOL, rtol=0)

    spans = [(0, 9), (9, 1), (10, 13), (23, 7)] + [(p, 1) for p in range(30, 40)]
    rows = _run(_runner(ckpt.path), tokens, table, spans)
    for (start, n), row in zip(spans, rows, strict=True):
        torch.testing.assert_close(row, ref[start + n - 1], atol=ATOL, rtol=0)


def test_dynamic_rope_beyond_max_positions_matches_transformers(hf_checkpoint) -> None:
    """Past max_position_embeddings dynamic NTK rescales by the prompt's length, as transformers does
    when it sees the whole prompt in one forward (the model reads it from the chunk's layout;
    tests/engine/test_engine_fidelity_attention.py covers chunking and decodes)."""
    ckpt = hf_checkpoint(
        "llama", max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    tokens = torch.randint(0, 211, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = ckpt.logits(tokens)
    runner = _runner(ckpt.path)
    assert runner.spec.max_model_len == 64
    layout = ChunkLayout(0, 50, 0, list(range(13)), num_prompt_tokens=50)
    meta = build_metadata([layout], [49], block_size=4, device=torch.device("cpu"))
    logits = runner.model.forward(torch.tensor(tokens), torch.arange(50), meta, runner.kv_cache)
    torch.testing.assert_close(logits[0], ref[49], atol=ATOL, rtol=0)


def test_the_head_gives_each_rows_argmax_with_the_logits(hf_checkpoint) -> None:
    """Where the LM head is in column panels, `forward(greedy_out=...)` also writes each row's
    `torch.argmax` (found inside the product), for several rows and for one."""
    ckpt = hf_checkpoint()
    runner = _runner(ckpt.path)
    if not runner.model.greedy_in_head:
        pytest.skip("the LM head is not in column panels here")
    tokens = torch.randint(0, 211, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    layout = ChunkLayout(0, 20, 0, list(range(5)))
    for rows in ([3, 7, 19], [19]):
        meta = build_metadata([layout], rows, block_size=4, device=torch.device("cpu"))
        greedy = torch.full((len(rows),), -1, dtype=torch.long)
        logits = runner.model.forward(torch.tensor(tokens), torch.arange(20), meta, runner.kv_cache, greedy_out=greedy)
        assert greedy.tolist() == logits.argmax(dim=-1).tolist()


def test_logits_only_for_sampling_chunks(hf_checkpoint) -> None:
    ckpt = hf_checkpoint()
    runner = _runner(ckpt.path)
    seq = SequenceState(list(range(12)), [0, 1, 2])
    ids, logits = runner.compute_logits([ScheduledChunk("r", 0, 12, True, False)], {"r": seq})
    assert ids == () and logits.shape == (0, 211)


def test_transformers_4_config_spelling_matches(hf_checkpoint) -> None:
    """The same checkpoint with its config.json rewritten in 4.x spelling (rope_theta + rope_scaling,
    torch_dtype) loads to the same logits."""
    import json

    ckpt = hf_checkpoint("llama", rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 2e4})
    config = json.loads((ckpt.path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    config["torch_dtype"] = config.pop("dtype", "float32")
    (ckpt.path / "config.json").write_text(json.dumps(config))
    runner = _runner(ckpt.path)
    assert (runner.spec.rope.rope_type, runner.spec.rope.factor, runner.spec.rope.theta) == ("linear", 3.0, 2e4)
    tokens = list(range(5, 30))
    rows = _run(runner, tokens, list(range(7)), [(0, 25)])
    torch.testing.assert_close(rows[0], ckpt.logits(tokens)[24], atol=ATOL, rtol=0)
