"""A fixed synthetic text corpus for training the demo tokenizer, generated locally from a seed.

What it owns: deterministic text (the same on every machine and Python version: only
`random.Random` with a fixed seed and literals below) mixing English function words, invented
words with a Zipf-like frequency, numbers, punctuation, code-like lines and some non-ASCII
words (accents, CJK, emoji), so a byte-level BPE trained on it has varied merges, including
multi-byte UTF-8 ones. It carries no meaning.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_COMMON = _words(
    "the of and to in is was for that with as on by at from it this be are or an which have not but had his "
    "they you were their one all we can her has there been if more when will would who so no out up into do "
    "time only about then than them these could some may first other new also after over any two most such"
)
_ONSETS = _words("b c d f g h j k l m n p r s t v w z br cr dr fl gr pl st tr ch sh th qu")
_VOWELS = _words("a e i o u ae ai ea ee ie io oa ou y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rk", "x")
_UNICODE = _words(
    "café naïve über façade smörgåsbord élan niño Øresund straße 日本語 東京 中文 한국어 Привет мир "
    "Ελληνικά עברית العربية हिन्दी 🙂 🚀 ✨ 🎉 ∑ ∞ → ≤ ≥ ± × ÷ € £ ¥ © ®"
)
_CODE = (
    "def {w}({v}):\n    return {v} + {n}\n",
    "for {v} in range({n}):\n    {w}.append({v})\n",
    "if {v} is None:\n    raise ValueError('{w}')\n",
    "{w} = {{'{v}': {n}, 'ok': True}}\n",
    "class {W}:\n    {v}: int = {n}\n",
)


def _word(rng: random.Random) -> str:
    syllables = rng.choice((1, 2, 2, 3, 3, 4))
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _lexicon(rng: random.Random, size: int) -> list[str]:
    words: dict[str, None] = {}
    while len(words) < size:
        words[_word(rng)] = None
    return list(words)


def _sentence(rng: random.Random, lexicon: list[str]) -> str:
    words = []
    for _ in range(rng.randint(4, 18)):
        roll = rng.random()
        if roll < 0.45:
            words.append(rng.choice(_COMMON))
        elif roll < 0.97:
            # Skewed: low indices are much more frequent, every word still appears.
            words.append(lexicon[int(len(lexicon) * rng.random() ** 3)])
        elif roll < 0.985:
            words.append(rng.choice(_UNICODE))
        else:
            words.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
    words[0] = words[0].capitalize()
    text = " ".join(words)
    if rng.random() < 0.2:
        cut = rng.randint(1, len(words) - 1)
        text = " ".join(words[:cut]) + ", " + " ".join(words[cut:])
    return text + rng.choice(".....?!;:")


def _code(rng: random.Random, lexicon: list[str]) -> str:
    w, v = rng.choice(lexicon[:2000]), rng.choice(lexicon[:500])
    return rng.choice(_CODE).format(w=w, W=w.capitalize(), v=v, n=rng.randint(0, 999))


def demo_corpus(*, seed: int = 0, num_lines: int = 40_000, lexicon_size: int = 60_000) -> Iterator[str]:
    """`num_lines` lines of synthetic text (paragraphs of sentences, some code), reproducible from `seed`."""
    rng = random.Random(seed)
    lexicon = _lexicon(rng, lexicon_size)
    for _ in range(num_lines):
        if rng.random() < 0.08:
            yield _code(rng, lexicon)
        else:
            yield " ".join(_sentence(rng, lexicon) for _ in range(rng.randint(1, 4)))
