"""Streaming text out of token ids: incremental detokenization and stop strings, the one
implementation the loop applies to every request that has text (the engine's and the server's).

`IncrementalDetokenizer` turns a growing list of output token ids into text deltas. It decodes a
small window, a context (the tokens of the last delta; at first the prompt's last few) plus the
tokens not emitted yet, and emits only the part after the context's text, so spacing rules that
depend on the previous token (SentencePiece's leading space) come out right. A delta is held back
while it is "" or ends in U+FFFD: a byte-level token that ends inside a multi-byte UTF-8 character
is never emitted half; the next token completes it.

Held-back tokens are bounded, so that a long run of tokens that add no character (special tokens
skipped under `ignore_eos`, byte tokens that never complete a character) costs linear time, not
quadratic. An `add` that finds `MAX_HELD_TOKENS` or more held back first releases all but the last
1 to 3 of them (a character is at most 4 bytes: at most 3 of its byte tokens can be waiting for
the next one). It emits the longest such leading part whose delta is final (neither "" nor ending in
U+FFFD), the delta a smaller `add` would have emitted there, and makes it the context. If there is
none, it gives up on all but the last 3: it emits their delta as it stands ("" or ending in U+FFFD)
and drops them from the window, keeping the context, so the tokens after them decode after the same
context as if the dropped ones were not there (a SentencePiece leading space after a run of skipped
special tokens survives). The context's text is cached until the context changes, so each `add`
makes one decode (one more right after a delta, up to three more while releasing), each of at most
the context, `MAX_HELD_TOKENS` held tokens and the tokens of this `add` and the previous one.

Invariant (for a prompt that ends on a character boundary): the concatenated deltas plus `flush()`
equal `decode(prompt + output)[len(decode(prompt)):]`, the text the output adds; for byte-level BPE
that is exactly `decode(output)`. The bound changes that only where an `add` gives up on held tokens
that are not all special tokens the decode skips (dropping those changes nothing: they add no text
either way). An `add` gives up only when `MAX_HELD_TOKENS` or more tokens are held and their text,
with any of the last 1 to 3 left out, still is "" or ends inside a character: that takes a character
not completed within 4 tokens, i.e. bytes that never form one, or skipped special tokens among the
bytes of one. Output without such a character is never changed, whatever the sizes of the adds.
Where it gives up, the output is cut in two, each side decoded after the same context: for
byte-level BPE, `decode(a) + decode(b)` instead of `decode(a + b)`, so a character whose bytes
straddle the cut comes out as U+FFFD on both sides of it (a run of lone bytes, each its own U+FFFD,
comes out the same either way).

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

MAX_HELD_TOKENS = 16
"""Held-back tokens an `add` tolerates before it releases them (see the module docstring): well
above the 3 that one character's byte tokens can hold back, so that only a run of 13 or more tokens
that complete no character is ever given up on, and small enough that the window stays short."""

_KEPT_ON_RELEASE = 3  # a UTF-8 character is at most 4 bytes: at most 3 byte tokens wait for the next


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
        # the window: context (emitted tokens, decoded for their spacing) + held-back tokens
        self._window: list[int] = list(prompt_token_ids[-num_context_tokens:]) if num_context_tokens else []
        self._num_context = len(self._window)
        self._context_text: str | None = None  # decode of the context; None until decoded
        self._held_text = ""  # the text the held-back tokens add ("" or ending in U+FFFD)
        self._pieces: list[str] = []
        self.token_ids: list[int] = []  # output ids only

    @property
    def text(self) -> str:
        """Output text emitted so far."""
        return "".join(self._pieces)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _delta(self, end: int) -> str:
        """The text `self._window[:end]` adds after the context ("" when it does not extend it)."""
        if self._context_text is None:
            self._context_text = self._decode(self._window[: self._num_context])
        prefix = self._context_text
        window = self._window
        full = self._decode(window if end == len(window) else window[:end])
        return full[len(prefix) :] if len(full) > len(prefix) and full.startswith(prefix) else ""

    def _advance(self, end: int) -> None:
        """`self._window[num_context:end]` is emitted: those tokens become the context."""
        del self._window[: self._num_context]
        self._num_context = end - self._num_context
        self._context_text, self._held_text = None, ""

    def _release(self) -> str:
        """Too many tokens held back: emit all but the last 1 to 3 (see the module docstring)."""
        end, delta = len(self._window), ""
        for _ in range(_KEPT_ON_RELEASE):
            end -= 1
            delta = self._delta(end)
            if delta and not delta.endswith(_REPLACEMENT):
                self._advance(end)
                return delta
        del self._window[self._num_context : end]  # give up on them; the context (and its text) stays
        return delta

    def add(self, token_ids: Iterable[int]) -> str:
        """Append output tokens; return the new text that is final (possibly "")."""
        new = list(token_ids)
        self.token_ids.extend(new)
        released = ""
        if len(self._window) - self._num_context >= MAX_HELD_TOKENS:
            released = self._release()  # then 1 to 3 tokens are still held: decode below
        elif not new:
            return ""
        window = self._window
        window.extend(new)
        delta = self._delta(len(window))
        if delta and not delta.endswith(_REPLACEMENT):  # emitted: its tokens become the context
            self._advance(len(window))
        else:
            self._held_text, delta = delta, ""
        if released:
            delta = released + delta
        if delta:
            self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever is still held back (an incomplete last character decodes as U+FFFD)."""
        text, self._held_text = self._held_text, ""
        self._window, self._num_context, self._context_text = [], 0, None
        if text:
            self._pieces.append(text)
        return text


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
