"""Block hashes: the chain over prompt tokens, its continuation over output tokens, and what the
scheduler does with it (a later prompt that repeats a conversation hits its output blocks)."""

from __future__ import annotations

import pytest

from contbatch.core import ContinuousScheduler, Request, SchedulerConfig
from contbatch.core.block_hashes import extend_block_hashes, prompt_block_hashes
from contbatch.core.config import KVConfig

from .drive import step


def with_outputs(request: Request, token_ids: list[int]) -> Request:
    request.output_token_ids.extend(token_ids)
    request.num_output_tokens += len(token_ids)
    return request


def test_prompt_hashes_chain_over_full_blocks_only() -> None:
    ids = list(range(10))
    assert len(prompt_block_hashes(ids, 4)) == 2
    assert prompt_block_hashes(ids, 4)[0] == prompt_block_hashes(ids[:4], 4)[0]
    assert prompt_block_hashes([9, *ids[1:]], 4)[1] != prompt_block_hashes(ids, 4)[1]  # block 1 covers block 0
    assert prompt_block_hashes(ids[:3], 4) == ()


def test_output_blocks_hash_as_the_same_tokens_given_as_a_prompt() -> None:
    prompt, outputs = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]
    r = with_outputs(
        Request("r", 0.0, 6, 8, prompt_token_ids=tuple(prompt), block_hashes=prompt_block_hashes(prompt, 4)), outputs
    )
    extend_block_hashes(r, 4, 2)
    assert r.block_hashes == prompt_block_hashes(prompt + outputs, 4)[:2]
    extend_block_hashes(r, 4, 1)  # never shrinks
    assert len(r.block_hashes) == 2
    with pytest.raises(ValueError, match="not full"):
        extend_block_hashes(r, 4, 3)  # 11 known tokens: block 2 is not full


def test_without_prompt_ids_the_blocks_after_the_trace_hashes_are_the_requests_own() -> None:
    a = with_outputs(Request("a", 0.0, 6, 8, block_hashes=(1,)), [7, 7])
    b = with_outputs(Request("b", 0.0, 6, 8, block_hashes=(1,)), [7, 7])
    extend_block_hashes(a, 4, 2)
    extend_block_hashes(b, 4, 2)
    assert a.block_hashes[0] == b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]


def test_a_prompt_repeating_a_conversation_hits_its_output_blocks() -> None:
    kv = KVConfig(block_size=4, num_blocks=32, watermark=0.0, enable_prefix_caching=True)
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64, kv=kv))
    prompt = list(range(3, 9))
    first = Request("first", 0.0, 6, 6, prompt_token_ids=tuple(prompt), block_hashes=prompt_block_hashes(prompt, 4))
    s.add_request(first, 0.0)
    now = 0.0
    while s.has_unfinished():
        step(s, now)
        now += 1.0
    turn = prompt + first.output_token_ids + [1, 2]  # 6 + 6 + 2 = 14 tokens: 3 full blocks
    second = Request("second", now, 14, 2, prompt_token_ids=tuple(turn), block_hashes=prompt_block_hashes(turn, 4))
    s.add_request(second, now)
    out = s.schedule(now)
    (chunk,) = out.chunks
    assert chunk.start == 8  # blocks 0 and 1 (prompt, and prompt + first outputs); block 2 held
    # positions 8-11, of which first computed only 8-10 (its last output was never fed back)
    assert s.stats.num_prefix_hit_tokens == 8
