"""The `sim` backend: the simulator's cost model, paced in real time, behind the real server.

Each step sleeps for the time its cost model (`contbatch.sim.cost`, in seconds) prices it at, so
tokens leave the server exactly when a GPU server with that step time would emit them, and the
same trace gives the same timelines as `contbatch simulate`, plus HTTP overhead.

Pacing: a step starts when the driver launches it, except that a step launched right after the
previous one (within one step time of its end, with no idle wait in between) starts when that
one ended: the driver's own CPU time overlaps the device step, as with asynchronous scheduling,
so the loop's overhead does not accumulate and the step boundaries stay where the simulator
puts them.

Tokens: prompts are counted, not really tokenized. The rule: the text is split on whitespace,
and each word counts ceil(UTF-8 bytes / 4) tokens (one token per started 4 bytes: "the" is 1,
"hello" is 2), so a prompt of N short words (at most 4 bytes each) is N tokens. The token ids
are CRC-32 hashes of those 4-byte pieces modulo `VOCAB_SIZE` (equal texts, equal ids: prefix
caching works). A chat prompt is the message contents joined by newlines (no role markers). A
prompt given as token ids is used as is.

Outputs are dummy tokens (id `OUTPUT_TOKEN_ID`), each decoded as the fixed word `OUTPUT_WORD`,
so the text is never empty. A request produces `max_tokens` tokens when `ignore_eos` is set;
otherwise an end-of-sequence may come first: its position is drawn from a geometric law with
mean `EOS_MEAN` tokens, by a generator seeded with the request's `seed` (or, without one, its
prompt ids and max_tokens), so the same request always stops at the same length (reason
``stop``; ``length`` when the draw is past max_tokens). Speculative decode chunks accept every
draft.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable, Sequence

from contbatch.core.config import SchedulerConfig
from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.loop.params import SamplingParams
from contbatch.server.backends.base import BackendError, ChatMessage
from contbatch.sim.cost import CostModel
from contbatch.sim.executor import sample_counting_down

VOCAB_SIZE = 32_000
BYTES_PER_TOKEN = 4
OUTPUT_TOKEN_ID = 1
OUTPUT_WORD = " tok"
EOS_MEAN = 128.0  # mean output length when the end-of-sequence is honoured (ignore_eos false)


def count_tokens(text: str) -> int:
    """The sim's prompt length rule: each whitespace-separated word is ceil(bytes / 4) tokens."""
    return sum(math.ceil(len(word.encode("utf-8")) / BYTES_PER_TOKEN) for word in text.split())


def tokenize(text: str) -> tuple[int, ...]:
    ids: list[int] = []
    for word in text.split():
        raw = word.encode("utf-8")
        for start in range(0, len(raw), BYTES_PER_TOKEN):
            ids.append(zlib.crc32(raw[start : start + BYTES_PER_TOKEN]) % VOCAB_SIZE)
    return tuple(ids)


_ASCII_SPACE = bytes(c for c in range(128) if chr(c).isspace())  # what str.split() splits on, ASCII
NON_ASCII_SPACE = "\x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
_OTHER_SPACE = tuple((c, len(c.encode())) for c in NON_ASCII_SPACE)  # the rest of what str.split() splits on
_SCAN_CHARS = 1 << 16


def min_tokens(text: str, *, stop_at: int | None = None) -> int:
    """A lower bound on `count_tokens(text)` at C speed: the bytes of its words over 4 (each
    word's ceil(bytes / 4) adds up to at least that). Scans 64K characters at a time and stops
    once the bound reaches `stop_at`, so a huge prompt is bounded from its beginning."""
    word_bytes = 0
    need = None if stop_at is None else stop_at * BYTES_PER_TOKEN
    for start in range(0, len(text), _SCAN_CHARS):
        part = text[start : start + _SCAN_CHARS]
        word_bytes += len(part.encode("utf-8", "surrogatepass").translate(None, _ASCII_SPACE))
        if not part.isascii():
            word_bytes -= sum(part.count(c) * size for c, size in _OTHER_SPACE)
        if need is not None and word_bytes >= need:
            break
    return -(-word_bytes // BYTES_PER_TOKEN)


def eos_length(prompt_token_ids: Sequence[int], params: SamplingParams) -> int | None:
    """Where the end-of-sequence falls (output tokens), or None when it never does before max_tokens."""
    max_tokens = params.max_tokens or 1
    if params.ignore_eos:
        return None
    if params.seed is not None:
        rng = random.Random(f"eos/{params.seed}")
    else:
        digest = zlib.crc32(repr(tuple(prompt_token_ids)).encode("ascii"))
        rng = random.Random(f"eos/{digest}/{max_tokens}")
    p = 1.0 / EOS_MEAN
    length = 1 + math.floor(math.log(1.0 - rng.random()) / math.log(1.0 - p))
    return length if length < max_tokens else None


class OutputWords:
    """The decoder of the sim's outputs: every token is `OUTPUT_WORD`."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return OUTPUT_WORD * len(token_ids)


class PacedSimExecutor:
    """Prices each step with the cost model and sleeps until its end (see the module docstring).
    It learns each request from the step outputs (its prompt ids and parameters, for where its
    end-of-sequence falls) and forgets it when it finishes."""

    def __init__(
        self,
        cost: CostModel,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cost = cost
        self._clock = clock
        self._sleep = sleep
        self._eos: dict[str, int] = {}  # request id -> output tokens left before its end-of-sequence
        self._known: set[str] = set()  # started and not finished (a resumed request keeps its countdown)
        self._prev_end: float | None = None

    def execute(self, out: SchedulerOutput) -> StepResult:
        self._apply(out)
        if not out.chunks:
            return StepResult()  # bookkeeping only: no time
        duration = self.cost.step_time(out)
        now = self._clock()
        prev = self._prev_end
        start = prev if prev is not None and 0.0 <= now - prev < duration else now
        end = start + duration
        while (left := end - self._clock()) > 0:
            self._sleep(left)
        self._prev_end = end
        return sample_counting_down(out, self._eos, OUTPUT_TOKEN_ID, lambda chunk: chunk.num_new_tokens)

    def _apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_ids:
            self._eos.pop(rid, None)
            self._known.discard(rid)
        for new in out.new_requests:
            if new.request_id in self._known:
                continue  # resumed after a preemption: its countdown goes on
            self._known.add(new.request_id)
            params = new.params if isinstance(new.params, SamplingParams) else SamplingParams()
            length = eos_length(new.prompt_token_ids, params)
            if length is not None:
                self._eos[new.request_id] = length

    def idle(self) -> None:
        self._prev_end = None  # the next step starts when it is launched


_NO_MODEL = "it has no model, so its dummy tokens have no probabilities"
# Request fields the sim cannot honour, refused with a 400 naming them (never accepted and
# ignored). `n` works (n requests; with a seed, choice i's end-of-sequence draws from seed + i),
# and so does `echo` of a text prompt; a prompt given as token ids cannot be echoed (its ids are
# hashes of the words).
UNSUPPORTED_FIELDS = {
    "logprobs": _NO_MODEL,
    "top_logprobs": _NO_MODEL,
    "top_k": _NO_MODEL,
    "min_p": _NO_MODEL,
    "presence_penalty": _NO_MODEL,
    "frequency_penalty": _NO_MODEL,
    "repetition_penalty": _NO_MODEL,
    "logit_bias": _NO_MODEL,
    "echo": "a prompt given as token ids cannot be turned back into text (its token ids are hashes)",
}


class SimBackend:
    name = "sim"
    unsupported_fields = UNSUPPORTED_FIELDS

    def __init__(self, cost: CostModel, config: SchedulerConfig, *, model_name: str = "contbatch-sim") -> None:
        if cost.time_unit != "s":
            raise BackendError(
                f"the sim backend paces steps in real time and needs a cost model in seconds (affine); "
                f"this one is in {cost.time_unit} units"
            )
        self.config = config
        self.model_name = model_name
        self.executor = PacedSimExecutor(cost)
        self.decoder = OutputWords()
        self.vocab_size = VOCAB_SIZE

    def tokenize(self, text: str) -> tuple[int, ...]:
        return tokenize(text)

    def min_prompt_tokens(self, text: str, *, stop_at: int | None = None) -> int:
        return min_tokens(text, stop_at=stop_at)  # the count rule's lower bound, untokenized

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
        return tokenize("\n".join(m.content for m in messages))  # the contents joined by newlines

    def idle(self) -> None:
        self.executor.idle()

    def close(self) -> None:
        pass
