"""The loader reads transformers 4.x and 5.x spellings, single and sharded safetensors, and answers
malformed or unsupported checkpoints with an error naming what and where."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from contbatch.core.outputs import ScheduledChunk
from contbatch.engine.demo import DemoShape, write_random_checkpoint
from contbatch.engine.errors import CheckpointError, UnsupportedModel
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.loader import load_checkpoint, load_spec
from contbatch.engine.runner import ModelRunner, SequenceState
from contbatch.engine.spec import ARCHITECTURES, Architecture, Biases, ConfigFields, parse_config

SHAPE = DemoShape(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    vocab_size=97,
    max_position_embeddings=64,
)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_random_checkpoint(tmp_path / "m", SHAPE, seed=1, demo=False)


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _base() -> dict:
    return {
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "vocab_size": 50,
    }


def test_v4_and_v5_spellings_give_the_same_spec() -> None:
    v4 = {**_base(), "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}, "torch_dtype": "bfloat16"}
    v5 = {**_base(), "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}, "dtype": "bfloat16"}
    assert parse_config(v4) == parse_config(v5)
    spec = parse_config(v5)
    assert (spec.rope.rope_type, spec.rope.theta, spec.rope.factor, spec.dtype) == ("linear", 5e5, 4.0, "bfloat16")
    assert spec.max_model_len == 4 * 2048 and spec.num_kv_heads == 4 and spec.head_dim == 8


def test_spec_fields_from_config() -> None:
    spec = parse_config(
        {
            **_base(),
            "model_type": "qwen2",
            "num_key_value_heads": 2,
            "head_dim": 16,
            "tie_word_embeddings": True,
            "eos_token_id": [5, 7],
        },
        generation_config={"eos_token_id": 9},
    )
    assert spec.qkv_bias and not spec.o_bias and spec.tie_word_embeddings
    assert (spec.num_kv_heads, spec.head_dim, spec.eos_token_ids) == (2, 16, (5, 7, 9))
    llama = parse_config({**_base(), "attention_bias": True, "mlp_bias": True})
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"model_type": "gpt2"}, UnsupportedModel, "model_type 'gpt2'"),
        ({"model_type": None}, CheckpointError, "model_type"),
        ({"hidden_size": None}, CheckpointError, "'hidden_size'"),
        ({"num_attention_heads": "four"}, CheckpointError, "'num_attention_heads'"),
        ({"num_key_value_heads": 3}, CheckpointError, "num_key_value_heads=3"),
        ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, UnsupportedModel, "'longrope'"),
        ({"rope_parameters": {"rope_type": "linear"}}, CheckpointError, "'factor'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, CheckpointError, "low_freq_factor"),
        ({"dtype": "int8"}, UnsupportedModel, "dtype 'int8'"),
        ({"quantization_config": {"quant_method": "gptq"}}, UnsupportedModel, "quantiz"),
        ({"partial_rotary_factor": 0.5}, UnsupportedModel, "partial_rotary_factor"),
        ({"model_type": "mistral", "sliding_window": 0}, CheckpointError, "'sliding_window'"),
        (
            {"model_type": "qwen2", "sliding_window": 8, "layer_types": ["sliding_attention"]},
            CheckpointError,
            "use_sliding_window",
        ),
        ({"model_type": "qwen2", "layer_types": ["local"]}, CheckpointError, "'layer_types'"),
    ],
)
def test_bad_configs_are_named(change: dict, error: type[Exception], words: str) -> None:
    raw = {k: v for k, v in {**_base(), **change}.items() if v is not None}
    with pytest.raises(error, match=r"cfg\.json") as info:
        parse_config(raw, source="cfg.json")
    assert words in str(info.value)


def test_sliding_windows_per_layer_as_transformers_reads_them() -> None:
    """Mistral: every layer; Qwen2: with use_sliding_window, layers from max_window_layers on (or as
    layer_types says); Llama: never; a window no shorter than max_model_len is dropped."""
    three = {**_base(), "num_hidden_layers": 3, "max_position_embeddings": 4096}
    mistral = {**three, "model_type": "mistral", "sliding_window": 1024}
    assert parse_config(mistral).layer_windows == (1024, 1024, 1024)
    assert parse_config(mistral, max_model_len=1024).layer_windows == ()
    assert parse_config({**mistral, "sliding_window": None}).layer_windows == ()
    qwen = {**three, "model_type": "qwen2", "sliding_window": 8, "max_window_layers": 1}
    assert parse_config(qwen).layer_windows == ()  # use_sliding_window is false by default
    assert parse_config({**qwen, "use_sliding_window": True}).layer_windows == (None, 8, 8)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert parse_config({**qwen, "use_sliding_window": True, "layer_types": types}).layer_windows == (8, None, 8)
    assert parse_config({**three, "sliding_window": 8}).layer_windows == ()  # llama: no sliding window
    with pytest.raises(UnsupportedModel, match="max_model_len"):
        parse_config(_base(), max_model_len=10**6)


def test_missing_files(tmp_path: Path, ckpt: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        load_spec(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_spec(empty)
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_checkpoint(ckpt)


def test_malformed_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not readable JSON"):
        load_spec(ckpt)


def _rewrite_weights(ckpt: Path, edit) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")


def test_missing_mis_shaped_and_unexpected_tensors(ckpt: Path) -> None:
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_checkpoint(ckpt)
    _rewrite_weights(ckpt, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(48, 31)}))
    with pytest.raises(CheckpointError, match=r"up_proj.weight' has shape \[48, 31\], config implies \[48, 32\]"):
        load_checkpoint(ckpt)
    _rewrite_weights(
        ckpt,
        lambda t: t.update(
            {"model.layers.1.mlp.up_proj.weight": torch.zeros(48, 32), "model.layers.0.mlp.fc1.weight": torch.zeros(2)}
        ),
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.fc1\.weight'"):
        load_checkpoint(ckpt)
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.0.mlp.fc1.weight"))
    load_checkpoint(ckpt)


def _shard(ckpt: Path) -> dict[str, str]:
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, ckpt / file)
        weight_map.update(dict.fromkeys(part, file))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_sharded_checkpoint_gives_the_same_logits(tmp_path: Path, ckpt: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(ckpt, sharded)
    _shard(sharded)

    def logits(path: Path) -> torch.Tensor:
        spec, weights = load_checkpoint(path)
        runner = ModelRunner(spec, weights, PagedKVCache(spec, 4, 8))
        return runner.compute_logits(
            [ScheduledChunk("r", 0, 6, True, True)], {"r": SequenceState([1, 5, 9, 2, 4, 7], [2])}
        )[1]

    assert torch.equal(logits(ckpt), logits(sharded))


def test_sharded_index_errors(ckpt: Path) -> None:
    weight_map = _shard(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lists shard 'model-00002-of-00002\.safetensors', which does not exist"):
        load_checkpoint(ckpt)
    moved = next(k for k, v in weight_map.items() if v.startswith("model-00002"))
    weight_map = {k: v for k, v in weight_map.items() if v.startswith("model-00001")}
    weight_map[moved] = "model-00001-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"the index lists tensors this shard lacks: \\['{moved}'\\]"):
        load_checkpoint(ckpt)


def test_tied_checkpoint_may_carry_an_lm_head(tmp_path: Path) -> None:
    shape = dataclasses.replace(SHAPE, tie_word_embeddings=True)
    path = write_random_checkpoint(tmp_path / "tied", shape, demo=False)
    _rewrite_weights(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    spec, weights = load_checkpoint(path)
    assert spec.tie_word_embeddings and "lm_head.weight" not in weights


# -- the architecture registry ------------------------------------------------------------------
def test_every_architecture_names_its_transformers_class_and_config() -> None:
    import transformers

    assert {"llama", "mistral", "qwen2"} <= set(ARCHITECTURES)
    for model_type, arch in ARCHITECTURES.items():
        cls = getattr(transformers, arch.hf_class)
        assert cls.config_class.model_type == model_type
        config = cls.config_class(**arch.full_attention_config).to_dict()
        spec = parse_config(config)  # transformers defaults, sliding windows off: supported as they are
        assert spec.model_type == model_type


@pytest.mark.parametrize(
    ("model_type", "fields", "biases"),
    [
        ("llama", {}, Biases()),
        ("llama", {"attention_bias": True}, Biases(qkv=True, o=True)),
        ("llama", {"mlp_bias": True}, Biases(mlp=True)),
        ("mistral", {"attention_bias": True, "mlp_bias": True}, Biases()),
        ("qwen2", {}, Biases(qkv=True)),
    ],
)
def test_biases_come_from_the_architecture(model_type: str, fields: dict, biases: Biases) -> None:
    spec = parse_config({**_base(), "model_type": model_type, **fields})
    assert Biases(spec.qkv_bias, spec.o_bias, spec.mlp_bias) == biases
    assert ARCHITECTURES[model_type].biases(ConfigFields({**_base(), **fields}, "x")) == biases


def test_one_registry_entry_adds_an_architecture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The recipe of docs/extending.md: a new model_type of the same decoder family is one entry."""
    with pytest.raises(UnsupportedModel, match="'toyllama'"):
        parse_config({**_base(), "model_type": "toyllama"})
    toy = Architecture("LlamaForCausalLM", biases=lambda f: Biases(o=True), sliding_windows=lambda f, n: (None,) * n)
    monkeypatch.setitem(ARCHITECTURES, "toyllama", toy)
    spec = parse_config({**_base(), "model_type": "toyllama", "sliding_window": 4})  # the window never applies
    assert spec.o_bias and not spec.qkv_bias and spec.max_model_len == 2048
    path = write_random_checkpoint(tmp_path / "toy", dataclasses.replace(SHAPE, model_type="toyllama"), demo=False)
    spec, weights = load_checkpoint(path)
    assert spec.model_type == "toyllama" and "model.layers.1.self_attn.o_proj.bias" in weights
    runner = ModelRunner(spec, weights, PagedKVCache(spec, 4, 8))
    _, logits = runner.compute_logits([ScheduledChunk("r", 0, 3, True, True)], {"r": SequenceState([1, 5, 9], [2])})
    assert logits.shape == (1, SHAPE.vocab_size) and torch.isfinite(logits).all()
