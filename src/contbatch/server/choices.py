"""The `n` choices of one response: `n` requests in the loop, their events merged.

A request with ``n`` > 1 is submitted as ``n`` independent requests (ids ``{response id}-{i}``;
with a ``seed`` s, choice i draws with seed s + i, wrapped into the 64-bit range, as vLLM's
child requests do; without one each draws from the engine's shared generator). They share the
prompt and every parameter, are scheduled, preempted and finished independently, and the
response merges their events: one SSE stream whose chunks name their choice by ``index``, or
one body with ``n`` choices. The response's status is decided by the first events: if any
choice is rejected (queue full, too long) all are aborted and the request gets that error. A
choice that fails later ends the whole response with its error (the rest are aborted).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from contbatch.loop.params import MAX_SEED, SamplingParams
from contbatch.server.client import EngineClient, RequestStream
from contbatch.server.types import RequestEvent, Submission

_WRAP = 1 << 64


def choice_submissions(submission: Submission, n: int) -> list[Submission]:
    """The `n` submissions of a request (itself when n is 1)."""
    if n == 1:
        return [submission]
    return [
        dataclasses.replace(
            submission, request_id=f"{submission.request_id}-{i}", params=choice_params(submission.params, i)
        )
        for i in range(n)
    ]


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: the seed moved by `index` (wrapped into the 64-bit range)."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    if seed > MAX_SEED:
        seed -= _WRAP
    return dataclasses.replace(params, seed=seed)


class Choices:
    """The streams of a request's choices, in choice order."""

    def __init__(self, streams: Sequence[RequestStream]) -> None:
        self.streams = list(streams)
        self.finals: list[RequestEvent | None] = [None] * len(self.streams)

    @classmethod
    def submit(cls, client: EngineClient, submissions: Sequence[Submission]) -> Choices:
        """Submit every choice; if one cannot be submitted the others are aborted and the error raised."""
        streams: list[RequestStream] = []
        try:
            for sub in submissions:
                streams.append(client.generate(sub))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return cls(streams)

    def __len__(self) -> int:
        return len(self.streams)

    async def first(self) -> RequestEvent | None:
        """Wait for every choice's first event; the first final one (a rejection), or None when all
        are queued."""
        rejected = None
        for stream in self.streams:
            event = await stream.first()
            if event.is_final and rejected is None:
                rejected = event
        return rejected

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    def fail(self, detail: str) -> None:
        """End every unfinished choice with an error (its output could not be delivered)."""
        for stream in self.streams:
            stream.fail(detail)

    def ack(self, index: int, num_tokens: int) -> None:
        self.streams[index].ack(num_tokens)

    async def events(self) -> AsyncIterator[tuple[int, RequestEvent]]:
        """(choice index, event) as they come, until every choice's final event."""
        if len(self.streams) == 1:
            async for event in self.streams[0]:
                if event.is_final:
                    self.finals[0] = event
                yield 0, event
            return
        async for item in self._merged():
            yield item

    async def _merged(self) -> AsyncIterator[tuple[int, RequestEvent]]:
        queue: asyncio.Queue[tuple[int, RequestEvent | BaseException]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for event in stream:
                    queue.put_nowait((index, event))
            except BaseException as exc:  # handed to the reader
                queue.put_nowait((index, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            left = len(self.streams)
            while left:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.is_final:
                    self.finals[index] = item
                    left -= 1
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
