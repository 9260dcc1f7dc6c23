"""Flat batches mixing prefill chunks and decodes of different lengths over random block tables, and
swap out/in, agree with transformers (each request alone, full forward) to 1e-4."""

from __future__ import annotations

import random

import torch

from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.loader import load_checkpoint
from contbatch.engine.runner import ModelRunner, SequenceState

ATOL = 1e-4
BLOCK_SIZE = 4


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tables(rng: random.Random, num_blocks: int, lengths: dict[str, int]) -> dict[str, list[int]]:
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = {}
    for rid, n in lengths.items():
        need = -(-n // BLOCK_SIZE)
        tables[rid], free = free[:need], free[need:]
    return tables


def _step(runner, plan, tokens, tables):
    """Run chunks {rid: (start, n)}; every chunk samples; return {rid: logits row}."""
    chunks = [ScheduledChunk(rid, s, n, n > 1, True) for rid, (s, n) in plan.items()]
    seqs = {rid: SequenceState(tokens[rid][: s + n], tables[rid]) for rid, (s, n) in plan.items()}
    ids, logits = runner.compute_logits(chunks, seqs)
    return dict(zip(ids, logits, strict=True))


def test_mixed_prefill_chunks_and_decodes_match_transformers(hf_checkpoint) -> None:
    ckpt = hf_checkpoint("llama", num_attention_heads=8, num_key_value_heads=2)
    lengths = {"a": 44, "b": 30, "c": 12, "d": 35, "e": 8}
    tokens = {rid: _tokens(i, n) for i, (rid, n) in enumerate(lengths.items())}
    refs = {rid: ckpt.logits(t) for rid, t in tokens.items()}
    spec, weights = load_checkpoint(ckpt.path)
    runner = ModelRunner(spec, weights, PagedKVCache(spec, 96, BLOCK_SIZE))
    tables = _tables(random.Random(3), 96, lengths)
    # Prompts: b 20, c 5, d 27, e 1; a is chunk-prefilled while the others decode.
    plans = [
        {"b": (0, 20), "c": (0, 5), "d": (0, 27), "e": (0, 1)},
        {"a": (0, 13), "b": (20, 1), "c": (5, 1), "d": (27, 1), "e": (1, 1)},
        {"b": (21, 1), "a": (13, 17), "e": (2, 1), "c": (6, 1), "d": (28, 1)},
        {"c": (7, 1), "d": (29, 1), "a": (30, 1), "e": (3, 1), "b": (22, 1)},
        {"a": (31, 13), "e": (4, 4), "c": (8, 1), "d": (30, 5), "b": (23, 1)},
    ]
    for plan in plans:
        rows = _step(runner, plan, tokens, tables)
        assert set(rows) == set(plan)
        for rid, (s, n) in plan.items():
            torch.testing.assert_close(rows[rid], refs[rid][s + n - 1], atol=ATOL, rtol=0, msg=f"{rid} {(s, n)}")


def test_decode_groups_split_by_length_still_match(hf_checkpoint) -> None:
    """Decodes of very different lengths run as several padded groups; each still matches."""
    ckpt = hf_checkpoint()
    lengths = {"short": 3, "mid": 30, "long": 100}
    tokens = {rid: _tokens(10 + i, n) for i, (rid, n) in enumerate(lengths.items())}
    spec, weights = load_checkpoint(ckpt.path)
    runner = ModelRunner(spec, weights, PagedKVCache(spec, 64, BLOCK_SIZE))
    tables = _tables(random.Random(5), 64, lengths)
    _step(runner, {rid: (0, n - 1) for rid, n in lengths.items()}, tokens, tables)
    batch = runner.build_batch(
        [ScheduledChunk(rid, n - 1, 1, False, True) for rid, n in lengths.items()],
        {rid: SequenceState(tokens[rid], tables[rid]) for rid in lengths},
    )
    assert len(batch.meta.decode_groups) >= 2
    rows = _step(runner, {rid: (n - 1, 1) for rid, n in lengths.items()}, tokens, tables)
    for rid, n in lengths.items():
        torch.testing.assert_close(rows[rid], ckpt.logits(tokens[rid])[n - 1], atol=ATOL, rtol=0)


def test_swapped_request_continues_with_identical_logits(hf_checkpoint) -> None:
    ckpt = hf_checkpoint()
    spec, weights = load_checkpoint(ckpt.path)
    tokens = {"a": _tokens(20, 23), "x": _tokens(21, 16)}
    blocks_a, new_blocks_a = [3, 9, 4, 12, 0, 6], [15, 1, 7, 13, 10, 2]

    def prefill(runner):
        return _step(runner, {"a": (0, 22)}, tokens, {"a": blocks_a})

    plain = ModelRunner(spec, weights, PagedKVCache(spec, 16, BLOCK_SIZE))
    prefill(plain)
    expected = _step(plain, {"a": (22, 1)}, tokens, {"a": blocks_a})["a"]

    swapping = ModelRunner(spec, weights, PagedKVCache(spec, 16, BLOCK_SIZE))
    prefill(swapping)
    swapping.apply_swaps(build_output(1, [], swapped_out=(("a", tuple(blocks_a)),)))
    assert swapping.kv_cache.swapped_ids == ("a",)
    # Another request overwrites every block "a" held.
    _step(swapping, {"x": (0, 16)}, tokens, {"x": blocks_a[:4]})
    _step(swapping, {"x": (0, 8)}, {"x": _tokens(22, 8)}, {"x": blocks_a[4:]})
    swapping.apply_swaps(build_output(2, [], swapped_in=(("a", tuple(new_blocks_a)),)))
    assert swapping.kv_cache.swapped_ids == ()
    got = _step(swapping, {"a": (22, 1)}, tokens, {"a": new_blocks_a})["a"]
    assert torch.equal(got, expected)
    torch.testing.assert_close(got, ckpt.logits(tokens["a"])[22], atol=ATOL, rtol=0)


def test_execute_applies_swaps_before_the_step(hf_checkpoint) -> None:
    """One SchedulerOutput swaps "a" out and gives its blocks to "b" in the same step; later "a" comes back."""
    ckpt = hf_checkpoint()
    spec, weights = load_checkpoint(ckpt.path)
    runner = ModelRunner(spec, weights, PagedKVCache(spec, 8, BLOCK_SIZE))
    reference = ModelRunner(spec, weights, PagedKVCache(spec, 8, BLOCK_SIZE))
    a, b = _tokens(30, 9), _tokens(31, 7)
    seqs = {"a": SequenceState(a, [0, 1, 2]), "b": SequenceState(b, [0, 1])}
    for r in (runner, reference):
        r.execute(build_output(0, [ScheduledChunk("a", 0, 9, True, True)]), {"a": seqs["a"]})
    runner.execute(
        build_output(1, [ScheduledChunk("b", 0, 7, True, True)], swapped_out=(("a", (0, 1, 2)),)), {"b": seqs["b"]}
    )
    a2 = [*a, 17]
    moved = SequenceState(a2, [5, 6, 7])
    got = runner.execute(
        build_output(2, [ScheduledChunk("a", 9, 1, False, True)], swapped_in=(("a", (5, 6, 7)),)), {"a": moved}
    )
    want = reference.execute(
        build_output(1, [ScheduledChunk("a", 9, 1, False, True)]), {"a": SequenceState(a2, [0, 1, 2])}
    )
    assert got.sampled_token_ids == want.sampled_token_ids
