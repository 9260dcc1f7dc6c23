"""The built-in demo model: a deterministic random-weight Llama and a byte-level BPE tokenizer.

What it owns: writing ordinary Hugging Face checkpoint directories (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a simple chat template), so the
same loader, and transformers, read them. The demo model has the "30M" shape (hidden 384, 6
layers, 6 heads, 2 KV heads, intermediate 1024, vocabulary 32,000, untied embeddings, 4,096
positions); its weights are random, so it produces meaningless text. It is labelled as such:
`"contbatch_demo": true` in config.json and a README.txt.

`ensure_demo_model()` creates it once under `$CONTBATCH_CACHE/demo-model` (default
`~/.cache/contbatch/demo-model`): built in a temporary sibling directory, then renamed into
place, so a reader never sees a half-written model and concurrent creators do not clash.
Everything is a pure function of the seed (weights from a seeded `torch.Generator`, the tokenizer
from a fixed synthetic corpus), so any machine builds the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from contbatch.engine.demo_corpus import demo_corpus
from contbatch.engine.spec import ARCHITECTURES, parse_config

DEMO_DIR_NAME = "demo-model"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<s>", "</s>", "<unk>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
README = """contbatch demo model

A Llama-architecture model with RANDOM weights (seed {seed}) and a byte-level BPE tokenizer
trained on synthetic text. It produces meaningless text. It exists so the contbatch engine and
server can run end to end without downloading anything. Created by contbatch.engine.demo.
"""


@dataclass(frozen=True, slots=True)
class DemoShape:
    """The shape of a random Llama-family checkpoint."""

    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    vocab_size: int = 32_000
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    model_type: str = "llama"  # a key of contbatch.engine.spec.ARCHITECTURES (qwen2 adds q/k/v biases)
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float | str], ...] = ()  # e.g. (("rope_type", "linear"), ("factor", 2.0))
    init_std: float = 0.02


DEMO_SHAPE = DemoShape()


def model_config(shape: DemoShape, *, demo: bool = True) -> dict[str, object]:
    """config.json contents (transformers 4.x spellings, which 5.x reads too)."""
    arch = ARCHITECTURES[shape.model_type]
    config: dict[str, object] = {
        "architectures": [arch.hf_class],
        "model_type": shape.model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": shape.rope_theta,
        "rope_scaling": dict(shape.rope_scaling) or None,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "torch_dtype": "float32",
        "initializer_range": shape.init_std,
    }
    config.update(arch.full_attention_config)
    if demo:
        config["contbatch_demo"] = True
    return config


def random_weights(shape: DemoShape, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers-named float32 weights: normal(0, init_std) matrices, unit norms; same seed, same tensors."""
    spec = parse_config(model_config(shape, demo=False), source=f"random {shape.model_type} checkpoint")
    generator = torch.Generator().manual_seed(seed)
    h, inter, head_dim = shape.hidden_size, shape.intermediate_size, shape.hidden_size // shape.num_heads
    q, kv = shape.num_heads * head_dim, shape.num_kv_heads * head_dim

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator) * shape.init_std

    weights = {"model.embed_tokens.weight": normal(shape.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            weights[f"{p}self_attn.{name}_proj.weight"] = normal(rows, h)
            if spec.qkv_bias:
                weights[f"{p}self_attn.{name}_proj.bias"] = normal(rows)
        weights[f"{p}self_attn.o_proj.weight"] = normal(h, q)
        if spec.o_bias:
            weights[f"{p}self_attn.o_proj.bias"] = normal(h)
        weights[f"{p}mlp.gate_proj.weight"] = normal(inter, h)
        weights[f"{p}mlp.up_proj.weight"] = normal(inter, h)
        weights[f"{p}mlp.down_proj.weight"] = normal(h, inter)
        if spec.mlp_bias:
            for name, rows in (("gate", inter), ("up", inter), ("down", h)):
                weights[f"{p}mlp.{name}_proj.bias"] = normal(rows)
        weights[f"{p}input_layernorm.weight"] = torch.ones(h)
        weights[f"{p}post_attention_layernorm.weight"] = torch.ones(h)
    if not shape.tie_word_embeddings:
        weights["lm_head.weight"] = normal(shape.vocab_size, h)
    return weights


def write_random_checkpoint(
    path: str | Path, shape: DemoShape = DEMO_SHAPE, *, seed: int = 0, demo: bool = True
) -> Path:
    """Write config.json, generation_config.json and model.safetensors of a random model into `path`."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(shape, demo=demo), indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(random_weights(shape, seed=seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def train_tokenizer(vocab_size: int = 32_000, corpus: Iterable[str] | None = None) -> Tokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenizer, BOS added) trained on `corpus` (default: `demo_corpus()`)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(demo_corpus() if corpus is None else corpus, trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def write_tokenizer(path: str | Path, tokenizer: Tokenizer, *, max_length: int = 4096) -> Path:
    """Write tokenizer.json and tokenizer_config.json (with `CHAT_TEMPLATE`) into `path`."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def create_demo_model(
    path: str | Path, shape: DemoShape = DEMO_SHAPE, *, seed: int = 0, corpus: Iterable[str] | None = None
) -> Path:
    """A complete labelled demo checkpoint directory at `path` (weights, tokenizer, README.txt)."""
    directory = write_random_checkpoint(path, shape, seed=seed, demo=True)
    write_tokenizer(directory, train_tokenizer(shape.vocab_size, corpus), max_length=shape.max_position_embeddings)
    (directory / "README.txt").write_text(README.format(seed=seed))
    return directory


def demo_cache_dir() -> Path:
    """`$CONTBATCH_CACHE/demo-model`, default `~/.cache/contbatch/demo-model`."""
    root = os.environ.get("CONTBATCH_CACHE") or Path.home() / ".cache" / "contbatch"
    return Path(root).expanduser() / DEMO_DIR_NAME


def ensure_demo_model(path: str | Path | None = None) -> Path:
    """The demo model directory, created (atomically: temp dir + rename) if it does not exist yet."""
    target = Path(path) if path is not None else demo_cache_dir()
    if (target / "README.txt").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        create_demo_model(staging)
        # mkdtemp and safetensors create owner-only entries; the cache is meant to be shared like any other.
        for entry in staging.iterdir():
            entry.chmod(0o644)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "README.txt").is_file():  # not a lost race with another creator
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
