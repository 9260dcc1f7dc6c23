"""IncrementalDetokenizer's bounded window (contbatch.loop.text): a long run of tokens that add no
character (skipped special tokens, byte tokens that never complete a character) costs a bounded
decode per `add`, not one that grows with the run; the streamed text is still the full decode,
except exactly where the module docstring says. Decode work is counted, never timed."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from contbatch.loop.text import MAX_HELD_TOKENS, IncrementalDetokenizer

FFFD = "\ufffd"
NUM_CONTEXT = 5  # IncrementalDetokenizer's default num_context_tokens
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away", "hello", "world"]


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(300)]


class CountingDecoder:
    """A `tokenizers.Tokenizer` as a `Decoder` that records how many ids each decode call gets."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        self.calls: list[int] = []

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.calls.append(len(token_ids))
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def text(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """A decode that is not counted (for expectations)."""
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        assert token_id is not None
        return int(token_id)


@pytest.fixture(scope="module")
def byte_level_backend() -> Tokenizer:
    """GPT-2 style byte-level BPE trained on ASCII words only: every byte of an emoji or a CJK
    character is a token of its own."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    return backend


@pytest.fixture(scope="module")
def sentencepiece_backend() -> Tokenizer:
    """Metaspace (Llama-2 style): a word's leading space depends on whether a token precedes it."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(_corpus(), trainer)
    return backend


@pytest.fixture
def byte_level(byte_level_backend: Tokenizer) -> CountingDecoder:
    return CountingDecoder(byte_level_backend)


@pytest.fixture
def sentencepiece(sentencepiece_backend: Tokenizer) -> CountingDecoder:
    return CountingDecoder(sentencepiece_backend)


def _bytes_of(tok: CountingDecoder, char: str) -> list[int]:
    """The byte tokens of one multi-byte character (the tokenizer has no merge for it)."""
    ids = tok.encode(char)
    assert len(ids) == len(char.encode()) and all(tok.text([i]) == FFFD for i in ids[:-1])
    return ids


def _added_text(tok: CountingDecoder, prompt: Sequence[int], output: Sequence[int], *, skip: bool = True) -> str:
    return tok.text([*prompt, *output], skip_special_tokens=skip)[len(tok.text(prompt, skip_special_tokens=skip)) :]


# (1) a run of tokens that add no character: bounded decodes per add, linear in total


@pytest.mark.parametrize("kind", ["skipped specials", "lone lead bytes", "stray continuation bytes", "mixed"])
def test_a_long_run_that_adds_no_character_decodes_a_bounded_window(byte_level: CountingDecoder, kind: str) -> None:
    tok = byte_level
    eos = tok.id("</s>")
    lead, continuation = _bytes_of(tok, "🙂")[:2]
    run = {
        "skipped specials": [eos] * 3000,
        "lone lead bytes": [lead] * 3000,
        "stray continuation bytes": [continuation] * 3000,
        "mixed": [eos, lead] * 1500,
    }[kind]
    prompt, before, after = tok.encode("Hello there"), tok.encode(" the cat"), tok.encode(" sat.")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in before]
    tok.calls.clear()
    calls_per_add = []
    for t in run:
        n = len(tok.calls)
        deltas.append(detok.add([t]))
        calls_per_add.append(len(tok.calls) - n)
    deltas += [detok.add([t]) for t in after] + [detok.flush()]

    window = NUM_CONTEXT + MAX_HELD_TOKENS
    assert max(tok.calls) <= window  # never the whole run: the window stays bounded
    assert max(calls_per_add) <= 1 + 1 + 3  # the window, the context once, a release's 3 tries
    releases = len(run) // (MAX_HELD_TOKENS - 3) + 1
    assert len(tok.calls) <= len(run) + 3 * releases + 2 * (len(after) + 1)
    assert sum(tok.calls) <= len(tok.calls) * window  # linear: about 20 ids an add, not 1,500
    # these runs cut nothing that was text: the stream is still the full decode
    assert "".join(deltas) == detok.text == _added_text(tok, prompt, [*before, *run, *after])


def test_a_held_add_decodes_the_window_once(byte_level: CountingDecoder) -> None:
    """The context's text is cached: an add that stays held back costs one decode, not two."""
    tok = byte_level
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    assert detok.add(tok.encode(" cat")) == " cat"
    tok.calls.clear()
    for t in [tok.id("</s>")] * (MAX_HELD_TOKENS - 1):
        assert detok.add([t]) == ""
    assert len(tok.calls) == (MAX_HELD_TOKENS - 1) + 1  # one window decode per add, the context once


# (2) the invariant on valid text


def _random_output(
    tok: CountingDecoder, rng: random.Random, specials: Sequence[int], pieces: Sequence[str]
) -> list[int]:
    """Whole pieces (so every boundary between pieces is a character boundary) with runs of
    special tokens between some of them, short or longer than the bound."""
    ids: list[int] = []
    for _ in range(rng.randint(5, 40)):
        ids += tok.encode(rng.choice(pieces))
        if rng.random() < 0.3:
            length = rng.choice((1, 2, 3, MAX_HELD_TOKENS, MAX_HELD_TOKENS + 1, 3 * MAX_HELD_TOKENS + 2))
            ids += [rng.choice(specials) for _ in range(length)]
    return ids


def _stream(detok: IncrementalDetokenizer, output: Sequence[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(output):
        step = rng.choice((1, 1, 1, 2, 3, 5, MAX_HELD_TOKENS + 4, 40))  # up to adds longer than the bound
        deltas.append(detok.add(output[i : i + step]))
        i += step
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_equal_the_full_decode_on_valid_text(byte_level: CountingDecoder, skip: bool) -> None:
    tok = byte_level
    pieces = ["the", " cat", " café", " 日本", "語", "🙂", "🚀", " ∑", "x", " Привет", "\n", "  ", "ß", "€", "𝔘"]
    specials = [tok.id("</s>"), tok.id("<s>")]
    rng = random.Random(0)
    for _ in range(60):
        prompt = tok.encode("".join(rng.choice(pieces) for _ in range(rng.randint(1, 10))))
        output = _random_output(tok, rng, specials, pieces)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = _stream(detok, output, rng)
        assert all(FFFD not in d for d in deltas)
        assert "".join(deltas) == detok.text == _added_text(tok, prompt, output, skip=skip)


def test_deltas_equal_the_full_decode_with_sentencepiece_spacing(sentencepiece: CountingDecoder) -> None:
    tok = sentencepiece
    specials = [tok.id("</s>"), tok.id("<s>")]
    rng = random.Random(1)
    for _ in range(60):
        prompt = tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6))))
        output = _random_output(tok, rng, specials, [f" {w}" for w in WORDS] + WORDS + ["."])
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(_stream(detok, output, rng)) == _added_text(tok, prompt, output)


# (3) at the bound, exactly as the module docstring says


def test_a_run_of_skipped_specials_keeps_the_sentencepiece_leading_space(sentencepiece: CountingDecoder) -> None:
    """Given-up specials are dropped and the context stays: " world" keeps its space (after the
    specials alone it would decode as "world")."""
    tok = sentencepiece
    eos, world = tok.id("</s>"), tok.encode(" world")
    assert tok.text(world) == "world" and tok.text([eos] * 3 + world) == "world"
    for run in (MAX_HELD_TOKENS, MAX_HELD_TOKENS + 1, 3 * MAX_HELD_TOKENS + 5, 200):
        detok = IncrementalDetokenizer(tok)
        assert detok.add(tok.encode("hello")) == "hello"
        tok.calls.clear()
        assert all(detok.add([eos]) == "" for _ in range(run))
        assert max(tok.calls) <= len(tok.encode("hello")) + MAX_HELD_TOKENS
        assert detok.add(world) == " world"
        assert detok.flush() == "" and detok.text == "hello world"


def test_a_run_reaching_the_bound_is_held_and_the_next_add_gives_up_on_all_but_the_last_3(
    byte_level: CountingDecoder,
) -> None:
    tok = byte_level
    lead = _bytes_of(tok, "🙂")[0]  # a lone lead byte decodes as one U+FFFD of its own
    detok = IncrementalDetokenizer(tok, tok.encode("ok"))
    assert all(detok.add([lead]) == "" for _ in range(MAX_HELD_TOKENS))  # held, up to the bound
    assert detok.add([lead]) == FFFD * (MAX_HELD_TOKENS - 3)  # given up on as it stands
    assert detok.add([]) == ""  # the 3 kept and the new one are still held
    assert detok.flush() == FFFD * 4
    assert detok.text == FFFD * (MAX_HELD_TOKENS + 1) == tok.text([lead] * (MAX_HELD_TOKENS + 1))
    # an empty add also releases, and the tokens kept are decoded again for flush
    detok = IncrementalDetokenizer(tok, tok.encode("ok"))
    assert all(detok.add([lead]) == "" for _ in range(MAX_HELD_TOKENS))
    assert detok.add([]) == FFFD * (MAX_HELD_TOKENS - 3)
    assert detok.flush() == FFFD * 3


def test_below_the_bound_nothing_is_released(byte_level: CountingDecoder) -> None:
    """The held run reaches MAX_HELD_TOKENS tokens, no more, before the character completes."""
    tok = byte_level
    eos, emoji = tok.id("</s>"), _bytes_of(tok, "🙂")
    output = [emoji[0], *[eos] * (MAX_HELD_TOKENS - len(emoji)), *emoji[1:]]
    assert len(output) == MAX_HELD_TOKENS
    detok = IncrementalDetokenizer(tok, tok.encode("ok"))
    deltas = [detok.add([t]) for t in output]
    assert deltas == [""] * (MAX_HELD_TOKENS - 1) + ["🙂"]


def test_a_release_emits_the_text_up_to_the_character_still_in_progress(byte_level: CountingDecoder) -> None:
    """An add longer than the bound that ends inside a character: the next add releases all but
    the last 1 to 3 tokens where that is a character boundary, so nothing is cut."""
    tok = byte_level
    smile, rocket = _bytes_of(tok, "🙂"), _bytes_of(tok, "🚀")
    words = tok.encode(" the cat sat on the mat and then it ran far away")
    chunk = [*words, *smile, rocket[0]]
    assert len(chunk) > MAX_HELD_TOKENS
    detok = IncrementalDetokenizer(tok, tok.encode("ok"))
    assert detok.add(chunk) == ""
    # keeping 1 token back is a boundary (keeping 3 would not be: inside the 🙂)
    assert detok.add([rocket[1]]) == " the cat sat on the mat and then it ran far away🙂"
    assert detok.add([rocket[2]]) == ""
    assert detok.add([rocket[3]]) == "🚀"
    assert detok.flush() == ""


def test_giving_up_inside_a_character_cuts_the_output_in_two(byte_level: CountingDecoder) -> None:
    """Skipped specials among one character's bytes: the give-up drops all but the last 3 held
    tokens, and the output is decode(a) + decode(b), each after the same context."""
    tok = byte_level
    eos, emoji = tok.id("</s>"), _bytes_of(tok, "🙂")
    prompt, end = tok.encode("ok"), tok.encode(" end")
    held = [*emoji[:2], *[eos] * (MAX_HELD_TOKENS - 2)]
    detok = IncrementalDetokenizer(tok, prompt)
    assert all(detok.add([t]) == "" for t in held)
    a, b = held[:-3], [*held[-3:], *emoji[2:], *end]
    assert detok.add([emoji[2]]) == _added_text(tok, prompt, a) == FFFD
    rest = [detok.add([t]) for t in [emoji[3], *end]] + [detok.flush()]
    assert "".join(rest) == _added_text(tok, prompt, b) == FFFD * 2 + " end"
    assert detok.text == _added_text(tok, prompt, a) + _added_text(tok, prompt, b)
    assert _added_text(tok, prompt, [*held, *emoji[2:], *end]) == "🙂 end"  # what it would be uncut
