"""A lower bound on a prompt's tokens without tokenizing it: the engine backend's
`min_prompt_tokens`, with which the server refuses a prompt too long for the model before
tokenizing it (`contbatch.server.admission`).

`bytes_per_token` is the most UTF-8 bytes of prompt text one token can stand for. A token's text
in the vocabulary (byte-level BPE's byte symbols, SentencePiece's ``▁`` and ``<0xNN>`` pieces,
WordPiece's ``##`` pieces, added tokens) is at least as many UTF-8 bytes as the input it covers,
so a prompt of B bytes has at least B / (the longest token's bytes) tokens. A normalizer may
shrink the text (compatibility forms and case folding turn up to 3 bytes into 1), so with one
that figure is multiplied by `NORMALIZER_SLACK`. There is no bound (None) when the tokenizer can
make one token of arbitrarily much text: a pre-tokenizer that drops text (BERT's whitespace
splitting, a split that removes its matches), or an unknown-token rule that fuses a run of
unknown characters into one token (WordPiece, WordLevel, Unigram or BPE without byte fallback).

Limitation: a normalizer that deletes characters (control characters, stripped accents) can
shrink a prompt further; such a prompt, which would tokenize to almost nothing, may be refused
as too long rather than tokenized.
"""

from __future__ import annotations

import json
from typing import Any

NORMALIZER_SLACK = 4
DROPPING_PRE_TOKENIZERS = frozenset({"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"})


def bytes_per_token(tokenizer: Any) -> int | None:
    """For a `tokenizers.Tokenizer`: the most prompt bytes one token covers, or None (no bound)."""
    spec = json.loads(tokenizer.to_str())
    if _drops_text(spec.get("pre_tokenizer")) or _fuses_unknowns(spec.get("model")):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=0)
    if longest < 1:
        return None
    return longest * (NORMALIZER_SLACK if spec.get("normalizer") else 1)


def _drops_text(node: object) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == "Sequence":
        return any(_drops_text(child) for child in node.get("pretokenizers", ()))
    return node.get("type") in DROPPING_PRE_TOKENIZERS or node.get("behavior") == "Removed"


def _fuses_unknowns(model: object) -> bool:
    if not isinstance(model, dict):
        return True
    kind = model.get("type")
    if kind == "BPE":
        return bool(model.get("fuse_unk")) and not model.get("byte_fallback")
    if kind == "Unigram":
        return not model.get("byte_fallback")
    return True  # WordPiece (a whole unknown word is one token), WordLevel, anything else


def min_tokens(text: str, per_token: int | None, *, stop_at: int | None = None) -> int:
    """At least this many tokens in `text` (0 without a bound). Characters are counted before
    bytes (there are at least as many bytes), so a huge prompt is bounded without encoding it."""
    if not per_token:
        return 0
    if stop_at is not None and len(text) >= stop_at * per_token:
        return len(text) // per_token
    return len(text.encode("utf-8", "surrogatepass")) // per_token
