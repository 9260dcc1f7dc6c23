"""Batch-size buckets (CUDA-graph style padding) with a paged-KV budget, stepped by hand.

`num_padding_tokens` is the next bucket minus the step's batched tokens; a step larger than the
largest bucket runs unpadded; an empty step is not padded; `stats.num_bucket_padding_tokens`
accumulates every step's padding. Padding is token-work only: it takes no KV blocks.
"""

from __future__ import annotations

import pytest

from contbatch.core import (
    ContinuousScheduler,
    Request,
    SchedulerConfig,
    SchedulerOutput,
    check_invariants,
)
from contbatch.core.config import KVConfig

from .drive import run_to_end, sampled


def make(buckets: tuple[int, ...], budget: int = 32) -> ContinuousScheduler:
    kv = KVConfig(block_size=4, num_blocks=32, watermark=0.0)
    return ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=budget, batch_buckets=buckets, kv=kv))


def run(s: ContinuousScheduler, requests: list[Request]) -> list[SchedulerOutput]:
    for r in requests:
        s.add_request(r, 0.0)
    return run_to_end(s, 0.0)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (1, [3, 3, 3]),  # 1 token -> bucket 4
        (4, [0, 3, 3]),  # exactly a bucket: no padding
        (5, [3, 3, 3]),  # 5 -> 8
        (9, [7, 3, 3]),  # 9 -> 16
        (16, [0, 3, 3]),  # the largest bucket exactly
        (17, [0, 3, 3]),  # above the largest bucket: unpadded
        (30, [0, 3, 3]),
    ],
)
def test_padding_is_the_next_bucket_minus_the_batched_tokens(prompt: int, expected: list[int]) -> None:
    s = make((4, 8, 16))
    outs = run(s, [Request("a", 0.0, prompt, 3)])
    assert [o.num_batched_tokens for o in outs] == [prompt, 1, 1]
    assert [o.num_padding_tokens for o in outs] == expected
    assert s.stats.num_bucket_padding_tokens == sum(expected)


def test_padding_follows_the_whole_step_and_accumulates() -> None:
    s = make((2, 8, 12))
    outs = run(s, [Request("a", 0.0, 3, 2), Request("b", 0.0, 6, 4), Request("c", 0.0, 1, 1)])
    sizes = [o.num_batched_tokens for o in outs]
    assert sizes == [10, 2, 1, 1]  # 3 + 6 + 1, then a and b decode, then b alone
    assert [o.num_padding_tokens for o in outs] == [2, 0, 1, 1]
    assert s.stats.num_bucket_padding_tokens == 4
    assert s.stats.as_dict()["num_bucket_padding_tokens"] == 4


def test_no_buckets_no_padding() -> None:
    s = make(())
    outs = run(s, [Request("a", 0.0, 5, 3)])
    assert all(o.num_padding_tokens == 0 for o in outs) and s.stats.num_bucket_padding_tokens == 0


def test_an_empty_step_is_not_padded() -> None:
    s = make((4, 8))
    out = s.schedule(0.0)
    assert out.is_empty and out.num_padding_tokens == 0 and s.stats.num_bucket_padding_tokens == 0


def test_padding_takes_no_kv_blocks() -> None:
    s = make((16,))
    s.add_request(Request("a", 0.0, 1, 2), 0.0)
    out = s.schedule(0.0)
    assert out.num_padding_tokens == 15
    assert s.memory is not None and s.memory.kv.num_used_blocks == 1
    s.update(out, sampled(out), 1.0)
    check_invariants(s)
