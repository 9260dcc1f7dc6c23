"""Admission before work: a prompt that cannot fit is refused before it is tokenized, and
tokenization runs on a small bounded pool of threads, never on the event loop.

- `check_prompt_size`: a text prompt whose length alone proves that it has at least
  ``max_model_len`` tokens gets a 400 naming the field, without being tokenized. The proof is
  the backend's `min_prompt_tokens` (a lower bound computed without tokenizing: the sim's count
  rule, the engine's bytes over the longest token's bytes; see the backends), which may stop
  counting once it has reached the limit, so refusing a 4 MB prompt costs microseconds.
- `TokenizerPool`: ``workers`` threads run long tokenizations (and what else a request needs
  done off the event loop); at most ``max_pending`` jobs are admitted (running or queued), and
  one more gets a 503 with ``Retry-After`` instead of piling up. Short prompts are tokenized
  there too while fewer than half of its places are taken (`has_spare_room`), on the event loop
  otherwise: the tokenizer releases Python's GIL, so a burst's prompts are tokenized beside the
  event loop reading the next requests (the handlers of 48 requests sent at once began over
  13-15 ms instead of 30 on the two-core machine measured). A job whose request went away
  before it started is dropped; the count of admitted jobs follows the jobs themselves, so an
  abandoned one keeps its place until its thread is done with it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from contbatch.server.client import EngineClient
from contbatch.server.protocol import APIError, bad

T = TypeVar("T")


def check_prompt_size(client: EngineClient, text: str, param: str) -> None:
    """400 naming `param` when `text` provably has at least max_model_len tokens (without a
    max_model_len: as many as the KV cache holds, so that it could never run)."""
    info = client.model
    if info.max_model_len is not None:
        limit, why = info.max_model_len, f"this model's maximum context length is {info.max_model_len} tokens"
    elif info.kv_capacity_tokens is not None:
        limit, why = info.kv_capacity_tokens, f"the KV cache holds {info.kv_capacity_tokens} tokens"
    else:
        return
    at_least = client.min_prompt_tokens(text, stop_at=limit)
    if at_least >= limit:
        raise bad(
            f"'{param}': {why}; the prompt has at least {at_least} ({len(text)} characters; refused without "
            "tokenizing it)",
            param,
        )


class TokenizerPool:
    """A bounded pool of worker threads (see the module docstring)."""

    def __init__(self, workers: int = 2, max_pending: int = 64, *, retry_after_s: int = 1) -> None:
        if workers < 1 or max_pending < 1:
            raise ValueError(f"a tokenizer pool needs workers >= 1 and max_pending >= 1, got {workers}, {max_pending}")
        self.workers = workers
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="contbatch-tokenize")
        self._lock = threading.Lock()
        self._pending = 0
        self.num_refused = 0  # jobs answered 503 since the start

    @property
    def pending(self) -> int:
        """Jobs admitted and not done (running or queued)."""
        return self._pending

    @property
    def has_spare_room(self) -> bool:
        """Fewer than half of `max_pending` jobs admitted: room for one that could as well run
        on the event loop (a short prompt), the other half kept for those that must not."""
        return self._pending < self.max_pending // 2

    async def run(self, job: Callable[[], T]) -> T:
        """`job()` on a worker thread; 503 when `max_pending` jobs are admitted already."""
        with self._lock:
            if self._pending >= self.max_pending:
                self.num_refused += 1
                raise APIError(
                    503,
                    f"the server is busy preparing {self._pending} other prompts; retry later",
                    code="server_busy",
                    headers={"Retry-After": str(self.retry_after_s)},
                )
            self._pending += 1
        try:
            future = self._executor.submit(job)
        except RuntimeError:  # shut down
            self._release(None)
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)  # cancelling this cancels a job not yet started

    def _release(self, _: object) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
