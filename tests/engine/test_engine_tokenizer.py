"""Tokenizer wrapper against transformers (encode, decode, chat templates), incremental detokenization
(never a partial UTF-8 character, equal to the full decode), and stop strings across deltas."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from contbatch.engine.chat_template import ChatTemplateError
from contbatch.engine.demo import CHAT_TEMPLATE, train_tokenizer, write_tokenizer
from contbatch.engine.demo_corpus import demo_corpus
from contbatch.engine.tokenizer import Tokenizer
from contbatch.loop.text import IncrementalDetokenizer, StopChecker, TextStream

TEXTS = [
    "Hello world, this is a test.",
    "café naïve 日本語 and emoji 🙂🚀 mixed — with “quotes”.",
    "def f(x):\n    return x + 1\n",
    "  leading spaces and trailing  ",
    "🎉🎉🎉 東京 Привет мир ∑∞",
]

RICH_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}{%- endif -%}
{{ bos_token }}{% if ns.system %}[SYS] {{ ns.system | trim }}
{% endif %}
{%- for message in messages if message['role'] != 'system' -%}
  {%- if message['role'] not in ['user', 'assistant'] -%}
{{ raise_exception('bad role ' + message['role']) }}{%- endif %}
  [{{ message['role'] | upper }}] {{ message['content'] }}{% if loop.last %} (last){% endif %}
{% if message.meta is defined %}{{ message.meta | tojson }}{% endif %}
{%- endfor -%}
{%- if add_generation_prompt %}[ASSISTANT]{% endif -%}
{%- if tools %} tools={{ tools | tojson }}{% endif -%}"""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = train_tokenizer(400, demo_corpus(num_lines=1500, lexicon_size=1500))
    return write_tokenizer(tmp_path_factory.mktemp("tok"), tokenizer)


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def test_encode_decode_match_transformers(tok_dir: Path, hf_tok) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.bos_token_id == hf_tok.bos_token_id and tok.eos_token_id == hf_tok.eos_token_id
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text)["input_ids"] and ids[0] == tok.bos_token_id
        assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE])
def test_chat_template_matches_transformers(tok_dir: Path, hf_tok, template: str) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "Name a colour", "meta": {"lang": "en", "x": "é<>"}},
            {"role": "assistant", "content": "Blue.", "tool_calls": None},
            {"role": "user", "content": "Another 🙂"},
        ],
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for messages in conversations:
        for add in (False, True):
            for extra in ({}, {"tools": tools}):
                want = hf_tok.apply_chat_template(
                    messages, chat_template=template, tokenize=False, add_generation_prompt=add, **extra
                )
                got = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=add, **extra)
                assert got == want
                ids = tok.apply_chat_template(
                    messages, chat_template=template, add_generation_prompt=add, tokenize=True, **extra
                )
                hf_ids = hf_tok.apply_chat_template(
                    messages,
                    chat_template=template,
                    add_generation_prompt=add,
                    tokenize=True,
                    return_dict=True,
                    **extra,
                )["input_ids"]
                assert ids == hf_ids


def test_chat_template_errors(tok_dir: Path) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=RICH_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% set ns = namespace(_x=1) %}")


def test_chat_template_jinja_file_wins(tok_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }} messages")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "1 messages"


def _random_text(rng: random.Random) -> str:
    pieces = ["the", " café", " 日本", "語", "🙂", "🚀", " ∑", "x", " Привет", "\n", "  ", "ß", "€", "𝔘"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(5, 40)))


def test_incremental_detokenizer_equals_full_decode_and_never_splits_utf8(tok_dir: Path) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    rng = random.Random(0)
    split_somewhere = False
    for _ in range(40):
        prompt = tok.encode(_random_text(rng))
        output = tok.encode(_random_text(rng), add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = []
        i = 0
        while i < len(output):
            step = rng.choice((1, 1, 1, 2, 3))
            deltas.append(detok.add(output[i : i + step]))
            i += step
        split_somewhere |= "" in deltas
        deltas.append(detok.flush())
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == detok.text == tok.decode(output)
    assert split_somewhere  # some token ended inside a character and its delta waited


def test_incremental_detokenizer_skips_special_tokens(tok_dir: Path) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    ids = [*tok.encode("ab"), tok.eos_token_id, *tok.encode(" cd", add_special_tokens=False)]
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tok.decode(ids) == "ab cd"


def _feed(checker: StopChecker, deltas: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for d in deltas:
        text, stopped = checker.feed(d)
        out.append(text)
        if stopped:
            break
    return out, stopped


def test_stop_string_across_deltas_is_never_streamed() -> None:
    out, stopped = _feed(StopChecker(["STOP"]), ["Hello S", "T", "O", "P and more"])
    assert stopped and "".join(out) == "Hello " and out[0] == "Hello "
    out, stopped = _feed(StopChecker(["STOP"], include_stop_str=True), ["Hello S", "TOP!"])
    assert stopped and "".join(out) == "Hello STOP"


def test_stop_checker_releases_false_starts_and_picks_the_earliest() -> None:
    checker = StopChecker(["abc", "bcd"])
    out, stopped = _feed(checker, ["xa", "b", "x", "ab", "cd"])
    assert stopped and "".join(out) == "xabx"
    checker = StopChecker(["\n\n"])
    text, stopped = checker.feed("line\n")
    assert (text, stopped) == ("line", False)
    assert checker.flush() == "\n"


def test_text_stream_combines_detokenizer_and_stop(tok_dir: Path) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.encode("one two 🙂 three END four", add_special_tokens=False)
    stream = TextStream(tok, tok.encode("prompt"), stop=["END"])
    text, stopped = "", False
    for t in ids:
        delta = stream.add([t])
        text += delta.text
        if delta.stopped:
            stopped = True
            break
    assert stopped and text == "one two 🙂 three "
    stream = TextStream(tok, (), stop=["nope"])
    text = "".join(stream.add([t]).text for t in ids) + stream.finish()
    assert text == tok.decode(ids)


def test_incremental_detokenizer_with_a_sentencepiece_style_tokenizer() -> None:
    """Metaspace + byte fallback (Llama-2 style): leading spaces depend on the previous token, and
    multi-byte characters arrive as <0x..> byte tokens; the stream still adds exactly the right text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(list(demo_corpus(num_lines=1500, lexicon_size=1500)), trainer)
    tok = Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    rng = random.Random(1)
    for _ in range(30):
        prompt = tok.encode(_random_text(rng))
        output = tok.encode(_random_text(rng), add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add([t]) for t in output] + [detok.flush()]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(prompt + output)[len(tok.decode(prompt)) :]
