"""`sample_counting_down`, the simulator's model-free step result."""

from __future__ import annotations

from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.core.status import FinishReason
from contbatch.sim.executor import sample_counting_down


def test_samples_in_chunk_order_with_drafts_and_countdowns() -> None:
    chunks = [
        ScheduledChunk("decode", 10, 1, False, True),
        ScheduledChunk("partial", 0, 8, True, False),  # a prefill chunk short of the prompt: no sample
        ScheduledChunk("drafts", 20, 4, False, True),
        ScheduledChunk("stops", 30, 3, False, True),
        ScheduledChunk("prompt", 0, 16, True, True),
        ScheduledChunk("counts", 5, 1, False, True),
    ]
    countdowns = {"stops": 2, "counts": 5, "absent": 1}
    calls: list[str] = []

    def decode_tokens(chunk: ScheduledChunk) -> int:
        calls.append(chunk.request_id)
        return chunk.num_new_tokens

    result = sample_counting_down(build_output(0, chunks), countdowns, 9, decode_tokens)
    assert list(result.sampled_token_ids.items()) == [
        ("decode", (9,)),
        ("drafts", (9, 9, 9, 9)),
        ("stops", (9, 9)),  # cut to its countdown
        ("prompt", (9,)),
        ("counts", (9,)),
    ]
    assert calls == ["drafts", "stops"]
    assert dict(result.finished) == {"stops": FinishReason.STOP}
    assert countdowns == {"stops": 0, "counts": 4, "absent": 1}


def test_several_stops_are_listed_in_chunk_order() -> None:
    chunks = [ScheduledChunk(rid, 4, 1, False, True) for rid in ("c", "a", "b")]
    countdowns = {"b": 1, "a": 1, "c": 1}
    result = sample_counting_down(build_output(0, chunks), countdowns, 0, lambda chunk: 1)
    assert list(result.finished) == ["c", "a", "b"]
    assert all(tokens == (0,) for tokens in result.sampled_token_ids.values())
