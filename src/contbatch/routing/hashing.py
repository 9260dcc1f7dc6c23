"""Stable hashing for routing: the same input gives the same 64-bit value in every process.

Python's `hash()` of a string changes from process to process (PYTHONHASHSEED), so a router
that placed requests by it would not reproduce, and a gateway and a simulator could never agree.
Everything here is built from `mix64` (the splitmix64 finalizer) and BLAKE2b.

Prefix keys are chained (key i mixes key i - 1 with block i's content), so two prompts share
their leading keys exactly as far as they share their leading full blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

MASK64 = (1 << 64) - 1


def mix64(value: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    x = (value + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def text_hash(text: str) -> int:
    """A stable 64-bit hash of `text` (BLAKE2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def chain(block_ids: Iterable[int]) -> tuple[int, ...]:
    """Chained keys of blocks given by a stable id each: key i depends on blocks 0..i."""
    keys: list[int] = []
    running = 0
    for block_id in block_ids:
        running = mix64(running ^ mix64(block_id & MASK64))
        keys.append(running)
    return tuple(keys)


def token_block_keys(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> tuple[int, ...]:
    """Chained keys of the full blocks of `token_ids` (at most `max_blocks` of them)."""
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    ids = []
    for b in range(count):
        h = 0
        for token in token_ids[b * block_size : (b + 1) * block_size]:
            h = mix64(h ^ (token & MASK64))
        ids.append(h)
    return chain(ids)


def text_block_keys(text: str, chars_per_block: int, max_blocks: int | None = None) -> tuple[int, ...]:
    """Chained keys of the full `chars_per_block`-character blocks of `text` (a gateway that does
    not tokenize hashes characters, as llm-d's prefix scorer does)."""
    count = len(text) // chars_per_block
    if max_blocks is not None:
        count = min(count, max_blocks)
    return chain(text_hash(text[b * chars_per_block : (b + 1) * chars_per_block]) for b in range(count))
