"""Prompt tokens equal transformers' (5.x, the installed version) for the same files.

Special tokens: with a `tokenizer.json`, transformers' `_from_pretrained` drops `add_bos_token` /
`add_eos_token` from tokenizer_config.json, whatever the `tokenizer_class`, so the post-processor
of `tokenizer.json` decides alone (none: nothing is added). Checked against `AutoTokenizer` for a
post-processor adding BOS, one adding EOS, a ByteLevel one and none, times every combination of
the flags, for three tokenizer classes, and for a SentencePiece-style (Metaspace) tokenizer that
transformers rebuilds as `LlamaTokenizer`.

Chat prompts: `Tokenizer.chat_prompt_ids`, the engine backend, the server and `contbatch generate
--chat` all give `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`: a
template that writes the BOS itself gets one BOS, not two, and the server's `usage.prompt_tokens`
and greedy output are transformers'.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from contbatch.engine.demo import DEMO_SHAPE, train_tokenizer, write_random_checkpoint, write_tokenizer
from contbatch.engine.demo_corpus import demo_corpus
from contbatch.engine.tokenizer import Tokenizer

TEXTS = ["abc def", "Hello world, this is a test.", "  café 日本 🙂 x ", "</s> inside <s> text"]
FLAGS: list[dict[str, bool]] = [
    {},
    {"add_bos_token": True},
    {"add_bos_token": False},
    {"add_eos_token": True},
    {"add_bos_token": False, "add_eos_token": True},
    {"add_bos_token": True, "add_eos_token": True},
]
POST_PROCESSORS = ("bos_template", "eos_template", "byte_level", "none")
CLASSES = ("PreTrainedTokenizerFast", "Qwen2Tokenizer", None)  # None: no tokenizer_class in the config
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _auto(path: Path) -> Any:
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def byte_level() -> HFTokenizer:
    return train_tokenizer(400, demo_corpus(num_lines=400, lexicon_size=400))


def _post_processor(name: str, tok: HFTokenizer) -> Any:
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    return {
        "bos_template": processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", bos)]
        ),
        "eos_template": processors.TemplateProcessing(
            single="$A:0 </s>:0", pair="$A:0 </s>:0 $B:1 </s>:1", special_tokens=[("</s>", eos)]
        ),
        "byte_level": processors.ByteLevel(trim_offsets=False),
        "none": None,
    }[name]


def _write(path: Path, tok: HFTokenizer, post: str, tokenizer_class: str | None, flags: dict[str, bool]) -> Path:
    tok = HFTokenizer.from_str(tok.to_str())  # a copy: the fixture is shared
    tok.post_processor = _post_processor(post, tok)
    write_tokenizer(path, tok)
    config = json.loads((path / "tokenizer_config.json").read_text())
    for name in ("add_bos_token", "add_eos_token", "tokenizer_class"):
        config.pop(name)
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    config.update(flags)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _assert_same_encoding(ours: Tokenizer, hf: Any) -> None:
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.parametrize(("post", "tokenizer_class"), list(itertools.product(POST_PROCESSORS, CLASSES)))
def test_special_token_flags_are_applied_as_transformers_applies_them(
    tmp_path: Path, byte_level: HFTokenizer, post: str, tokenizer_class: str | None
) -> None:
    added = set()
    for i, flags in enumerate(FLAGS):
        path = _write(tmp_path / f"t{i}", byte_level, post, tokenizer_class, flags)
        ours, hf = Tokenizer.from_dir(path), _auto(path)
        _assert_same_encoding(ours, hf)
        ids = ours.encode("abc")
        added.add((ids[0] == ours.bos_token_id, ids[-1] == ours.eos_token_id))
    # The flags change nothing: the post-processor of tokenizer.json alone decides.
    want = {"bos_template": (True, False), "eos_template": (False, True)}.get(post, (False, False))
    assert added == {want}


@pytest.fixture(scope="module")
def metaspace() -> HFTokenizer:
    backend = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(list(demo_corpus(num_lines=500, lexicon_size=500)), trainer)
    return backend


@pytest.mark.parametrize("post", ["bos_template", "none"])
def test_special_token_flags_of_a_sentencepiece_style_llama_tokenizer(
    tmp_path: Path, metaspace: HFTokenizer, post: str
) -> None:
    """transformers loads this one as `LlamaTokenizer` (it rebuilds the backend from the vocabulary
    and keeps the file's post-processor); the flags are dropped there too."""
    for i, flags in enumerate(FLAGS):
        path = _write(tmp_path / f"t{i}", metaspace, post, "LlamaTokenizer", flags)
        hf = _auto(path)
        assert type(hf).__name__ == "LlamaTokenizer"
        _assert_same_encoding(Tokenizer.from_dir(path), hf)


def test_the_issue_example_flags_beside_a_post_processor_without_bos(tmp_path: Path, byte_level: HFTokenizer) -> None:
    """tokenizer_config.json says add_bos_token, tokenizer.json's post-processor adds nothing:
    transformers gives no BOS, and so does the engine (it used to prepend one)."""
    path = _write(tmp_path / "t", byte_level, "byte_level", "PreTrainedTokenizerFast", {"add_bos_token": True})
    ours, hf = Tokenizer.from_dir(path), _auto(path)
    assert ours.encode("abc") == hf.encode("abc") and ours.encode("abc")[0] != ours.bos_token_id


# -- chat prompts ---------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour 🙂"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another"},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama whose tokenizer adds a BOS and whose chat template writes one too."""
    shape = dataclasses.replace(DEMO_SHAPE, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
    tok = train_tokenizer(400, demo_corpus(num_lines=400, lexicon_size=400))
    shape = dataclasses.replace(shape, vocab_size=tok.get_vocab_size(), max_position_embeddings=512)
    path = write_random_checkpoint(tmp_path_factory.mktemp("chat"), shape, seed=3, demo=False)
    write_tokenizer(path, tok, max_length=512)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = BOS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_chat_ids(chat_model: Path) -> list[int]:
    out = _auto(chat_model).apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def _hf_greedy(path: Path, prompt: list[int], num_new: int, *, ignore_eos: bool = True) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if ignore_eos:  # as the engine's ignore_eos: an EOS is an ordinary token (min_new_tokens would mask it)
        model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=num_new,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_chat_prompt_ids_equal_apply_chat_template_tokenize(chat_model: Path, hf_chat_ids: list[int]) -> None:
    tok = Tokenizer.from_dir(chat_model)
    ids = tok.chat_prompt_ids(MESSAGES)
    assert ids == hf_chat_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's BOS, once
    # Encoding the rendered text with special tokens (the old path) doubles the BOS.
    assert tok.encode(str(tok.apply_chat_template(MESSAGES))) == [tok.bos_token_id, *ids]


def test_the_backends_give_chat_prompt_ids(chat_model: Path, hf_chat_ids: list[int]) -> None:
    from contbatch.core import PRESETS
    from contbatch.server.backends import BackendOptions, make_backend
    from contbatch.server.backends.base import ChatMessage
    from contbatch.server.backends.sim import tokenize

    messages = [ChatMessage(m["role"], m["content"]) for m in MESSAGES]
    engine = make_backend("engine", PRESETS["engine"], BackendOptions(model=str(chat_model), kv_cache_memory=2**22))
    assert engine.chat_prompt_ids(messages) == tuple(hf_chat_ids)
    sim = make_backend("sim", PRESETS["engine"], BackendOptions(cost=_affine()))
    assert sim.chat_prompt_ids(messages) == tokenize("\n".join(m["content"] for m in MESSAGES))


def _affine() -> Any:
    from contbatch.sim.cost import parse_cost

    return parse_cost("affine:base_ms=1")


@pytest.fixture(scope="module")
def chat_server(chat_model: Path) -> Iterator[Any]:
    from server.harness import start_server

    from contbatch.core import PRESETS
    from contbatch.server.backends import BackendOptions, make_backend

    options = BackendOptions(model=str(chat_model), served_model_name="chat", kv_cache_memory=2**22)
    server = start_server(backend=make_backend("engine", PRESETS["engine"], options))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_the_server_counts_and_continues_the_chat_prompt_as_transformers(
    chat_model: Path, hf_chat_ids: list[int], chat_server: Any
) -> None:
    num_new = 8
    body = {
        "model": "chat",
        "messages": MESSAGES,
        "max_completion_tokens": num_new,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = chat_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["usage"]["prompt_tokens"] == len(hf_chat_ids)
    want = _hf_greedy(chat_model, hf_chat_ids, num_new)
    assert data["choices"][0]["message"]["content"] == Tokenizer.from_dir(chat_model).decode(want)


@pytest.mark.slow
def test_generate_chat_uses_the_chat_prompt_ids(chat_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from contbatch.cli.main import main

    messages = [{"role": "user", "content": "hello there"}]
    prompt = list(_auto(chat_model).apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    want = _hf_greedy(chat_model, prompt, 5, ignore_eos=False)  # the engine stops at EOS too
    assert main(["generate", "hello there", "--chat", "--model", str(chat_model), "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert f"; {len(want)} tokens;" in out
    assert f"\n{Tokenizer.from_dir(chat_model).decode(want)}\n" in out
