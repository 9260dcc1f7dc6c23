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


class SimBackend:
    name = "sim"

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

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        return "\n".join(m.content for m in messages)

    def idle(self) -> None:
        self.executor.idle()

    def close(self) -> None:
        pass
