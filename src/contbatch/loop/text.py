"""Streaming text out of token ids: incremental detokenization and stop strings, the one
implementation the loop applies to every request that has text (the engine's and the server's).

`IncrementalDetokenizer` turns a growing list of output token ids into text deltas. It decodes a
small window (a few tokens of already-emitted context plus the new ones) and emits only the part
after the context, so spacing rules that depend on the previous token (SentencePiece's leading
space) come out right. A delta is held back while the window's text ends in U+FFFD: a byte-level
token that ends inside a multi-byte UTF-8 character is never emitted half; the next token
completes it. Invariant (for a prompt that ends on a character boundary): the concatenated deltas
plus `flush()` equal `decode(prompt + output)[len(decode(prompt)):]`, the text the output adds;
for byte-level BPE that is exactly `decode(output)`.

`StopChecker` finds stop strings across delta boundaries: it holds back the longest tail that
could still begin a stop string, so a streamed client never sees text that a later stop string
match removes. On a match, the text before the stop string (and the stop string itself if
`include_stop_str`) is emitted and the request is done.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What detokenization needs of a tokenizer (`contbatch.engine.tokenizer.Tokenizer` has it)."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one request's output tokens; see the module docstring."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        num_context_tokens: int = 5,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-num_context_tokens:]) if num_context_tokens else []
        self._prefix_offset = 0  # window start: context tokens already emitted
        self._read_offset = len(self._ids)  # tokens before this are emitted
        self._pieces: list[str] = []
        self.token_ids: list[int] = []  # output ids only

    @property
    def text(self) -> str:
        """Output text emitted so far."""
        return "".join(self._pieces)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _pending_delta(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return full[len(prefix) :] if len(full) > len(prefix) and full.startswith(prefix) else ""

    def add(self, token_ids: Iterable[int]) -> str:
        """Append output tokens; return the new text that is final (possibly "")."""
        new = list(token_ids)
        self._ids.extend(new)
        self.token_ids.extend(new)
        delta = self._pending_delta()
        if not delta or delta.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever is still held back (an incomplete last character decodes as U+FFFD)."""
        delta = self._pending_delta()
        self._prefix_offset = self._read_offset = len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta


class StopChecker:
    """Stop-string detection over a stream of text deltas; see the module docstring."""

    def __init__(self, stop: Sequence[str], *, include_stop_str: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.include_stop_str = include_stop_str
        self._held = ""
        self.stopped_on: str | None = None  # the stop string that matched, once one did
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched). After a match, feed returns ("", True)."""
        if self.stopped_on is not None:
            return "", True
        buffer = self._held + delta
        matches = [(i, s) for s in self.stop if (i := buffer.find(s)) >= 0]
        if matches:
            index, stop = min(matches)
            self.stopped_on, self._held = stop, ""
            return buffer[: index + len(stop)] if self.include_stop_str else buffer[:index], True
        hold = self._hold_length(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def _hold_length(self, buffer: str) -> int:
        for k in range(min(len(buffer), self._max_hold), 0, -1):
            tail = buffer[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """The held-back tail, when the request ends for another reason."""
        held, self._held = self._held, ""
        return held


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # new text to send
    stopped: bool  # a stop string matched: the request is finished (STOP)


class TextStream:
    """Incremental detokenization followed by stop-string checks, for one request."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        *,
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.checker = StopChecker(stop, include_stop_str=include_stop_str)

    def add(self, token_ids: Iterable[int]) -> TextDelta:
        text, stopped = self.checker.feed(self.detokenizer.add(token_ids))
        return TextDelta(text, stopped)

    def finish(self) -> str:
        """The remaining text when the request ends without a stop-string match."""
        text, stopped = self.checker.feed(self.detokenizer.flush())
        return text if stopped else text + self.checker.flush()
