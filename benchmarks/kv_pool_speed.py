"""KV block layer speed: `KVCacheManager` / `BlockPool` on realistic allocate / grow / free patterns,
this working tree side by side with the code of a git commit (--baseline, default HEAD) in one run.

Scenarios (each a seeded, deterministic driver loop over one `KVCacheManager`, as the scheduler's
`Memory` would call it; the driver's decisions depend only on the manager's answers):
  plain   6,144 blocks of 16 tokens, no prefix caching: requests with azure-code-like prompts
          (lognormal, median about 1,500 tokens, so ~100 blocks at admission) and short outputs
          are admitted while blocks last, decode one token per step (a block every 16 tokens),
          the newest is preempted by recompute when growth fails, freed when done, and the
          executor's journal (`take_block_deltas`) is read every step;
  prefix  the same with prefix caching: requests share one of 8 system prompts (24-64 blocks)
          and register their full prompt blocks (`match_prefix`, `cache_blocks`);
  spec    plain with speculative decoding: 4 drafts allocated per step, rejected ones trimmed;
  swap    plain with preemption by swap to a 2,048-block host pool, swapped requests resumed first;
  pool    the `BlockPool` alone, no driver: 48 tables of 64-192 blocks; one of them
          released last block first and taken again, then grown by 8 single blocks (5 x --requests times).

Each run is a fresh process importing the code under test (the baseline: `git archive REF src`
extracted to a temporary folder, imported via PYTHONPATH, as benchmarks/sim_speed.py does); runs
alternate between the two. Timed: the driver loop's CPU time (its own bookkeeping included). A second,
untimed pass records every answer (grants, trims, swaps, journals, free counts) into two checksums:
one of the decisions (answers with block ids replaced by their counts), which must be equal for
both codes, and one block id for block id, equal unless the baseline orders its free list
differently (commits before vLLM's release order, where `prefix` may also decide differently:
which cached blocks survive depends on that order). Prints one table
(medians over --reps runs, paired speed-up = baseline time / ours) and writes JSON (--json-out).

    .venv/bin/python benchmarks/kv_pool_speed.py --reps 3 --baseline f14949e   # the pool before this layout
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers
from baseline_src import export_src, run_side

SCENARIOS = ("plain", "prefix", "spec", "swap", "pool")


def pool_only(num_cycles: int, record: bool) -> tuple[float, str]:
    """Scenario `pool`: (CPU seconds, checksum of every block id handed out)."""
    from contbatch.core.kv import BlockPool

    rng = random.Random(3)
    sizes = [rng.randint(64, 192) for _ in range(num_cycles)]
    picks = [rng.randrange(48) for _ in range(num_cycles)]
    pool = BlockPool(12_288, 16)
    tables = [pool.take(128) for _ in range(48)]
    log = hashlib.sha256()
    start = time.process_time()
    for size, pick in zip(sizes, picks, strict=True):
        table = tables[pick]
        table.reverse()
        pool.release(table)
        table = pool.take(size - 8)
        for _ in range(8):  # decode growth: a block at a time
            table += pool.take(1)
        tables[pick] = table
        if record:
            log.update(repr(table).encode())
    seconds = time.process_time() - start
    return seconds, log.hexdigest() + repr(pool.free_block_ids()) if record else ""


def without_ids(item: object) -> object:
    """`item` with its block ids replaced by their count: what the manager decided, not which blocks.
    Block ids come as tuples of ints (journal entries) or in `Grant` / `SwapOut` fields."""
    if isinstance(item, list):
        return [without_ids(x) for x in item]
    if isinstance(item, tuple):
        return len(item) if item and all(type(x) is int for x in item) else tuple(map(without_ids, item))
    fields = getattr(item, "__dataclass_fields__", None)
    if fields is None:
        return item
    return tuple(without_ids(getattr(item, name)) for name in fields)


def pool_only_decisions(num_cycles: int) -> str:
    """Scenario `pool`'s decisions: how many blocks each call handed out (the sizes alone)."""
    rng = random.Random(3)
    sizes = [rng.randint(64, 192) for _ in range(num_cycles)]
    return hashlib.sha256(repr(sizes).encode()).hexdigest()


class Driver:
    """One scenario's loop: admission, decode growth, preemption, completion."""

    def __init__(self, scenario: str, num_requests: int, record: bool) -> None:
        from contbatch.core.kv import KVCacheManager

        self.scenario = scenario
        self.block_size = 16
        self.kv = KVCacheManager(
            6144,
            self.block_size,
            enable_prefix_caching=scenario == "prefix",
            num_host_blocks=2048 if scenario == "swap" else 0,
        )
        rng = random.Random(7)
        self.requests: list[tuple[str, int, int, tuple[int, ...]]] = []  # id, prompt, output, hashes
        groups = [tuple(range(g * 1000, g * 1000 + rng.randint(24, 64))) for g in range(8)]
        for i in range(num_requests):
            prompt = min(8192, max(16, int(rng.lognormvariate(7.3, 0.7))))
            output = max(1, int(rng.expovariate(1 / 30)))
            hashes: tuple[int, ...] = ()
            if scenario == "prefix":
                shared = groups[rng.randrange(len(groups))]
                own = prompt // self.block_size - len(shared)
                hashes = (shared + tuple(range(10**6 + i * 1000, 10**6 + i * 1000 + own)))[: prompt // self.block_size]
            self.requests.append((f"r{i}", prompt, output, hashes))
        self.record = record
        self.log = hashlib.sha256() if record else None
        self.decisions = hashlib.sha256() if record else None

    def note(self, *items: object) -> None:
        if self.log is not None and self.decisions is not None:
            self.log.update(repr(items).encode())
            self.decisions.update(repr([without_ids(item) for item in items]).encode())

    def run(self) -> str:
        self.waiting = list(reversed(self.requests))  # pop() takes the next
        self.swapped: list[list[Any]] = []
        self.running: list[list[Any]] = []  # [id, prompt, output, hashes, tokens done, token capacity]
        step = 0
        while self.waiting or self.running or self.swapped:
            step += 1
            self.resume()
            self.admit()
            i = 0
            while i < len(self.running):  # decode: one token each (spec: drafts, some rejected)
                if self.decode(self.running[i], step, i):
                    i += 1
            kv = self.kv
            self.note("deltas", kv.take_block_deltas(), kv.num_free_blocks, kv.num_free_host_blocks)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        return f"{self.decisions.hexdigest()} {self.log.hexdigest()}" if self.log and self.decisions else ""

    def resume(self) -> None:
        """Swapped-out requests come back first, newest first."""
        while self.swapped:
            r = self.swapped[-1]
            grant = self.kv.swap_in(r[0])
            self.note("swap_in", r[0], grant)
            if not grant.granted:
                return
            r = self.swapped.pop()
            r[5] = self.kv.num_held_blocks(r[0]) * self.block_size
            self.running.append(r)

    def admit(self) -> None:
        """New requests while their prompts fit (none while some are swapped out)."""
        kv = self.kv
        while self.waiting and not self.swapped and len(self.running) < 256:
            rid, prompt, output, hashes = self.waiting[-1]
            if self.scenario == "prefix":
                self.note("match", kv.match_prefix(hashes))
            grant = kv.allocate(rid, prompt + 1, block_hashes=hashes)
            self.note("admit", rid, grant)
            if not grant.granted:
                return
            self.waiting.pop()
            if self.scenario == "prefix":
                kv.cache_blocks(rid, hashes, prompt)
            self.running.append([rid, prompt, output, hashes, 0, kv.num_held_blocks(rid) * self.block_size])

    def decode(self, r: list[Any], step: int, i: int) -> bool:
        """Running request `r` (at index `i`) decodes; False when it finished (and left `running`)."""
        kv, spec = self.kv, self.scenario == "spec"
        rid, prompt, output, done = r[0], r[1], r[2], r[4]
        end = prompt + done + 1 + (4 if spec else 0)
        if end > r[5]:  # as `Memory.grow`: the request knows its capacity
            self.grow(rid, end, i)
            r[5] = kv.num_held_blocks(rid) * self.block_size
        done = min(output, done + (1 + (step * 7 + i) % 5 if spec else 1))
        r[4] = done
        if spec:
            self.note("trim", rid, kv.trim(rid, prompt + done))
            r[5] = kv.num_held_blocks(rid) * self.block_size
        if done < output:
            return True
        self.note("free", rid, kv.free(rid))
        self.running.pop(i)
        return False

    def grow(self, rid: str, end: int, i: int) -> None:
        """Blocks for `end` tokens, preempting the newest requests (after index `i`) until they fit."""
        kv = self.kv
        grant = kv.allocate(rid, end)
        self.note("grow", rid, grant)
        while not grant.granted and len(self.running) > i + 1:
            victim = self.running.pop()
            out = kv.swap_out(victim[0]) if self.scenario == "swap" else None
            if out is not None:
                self.note("swap_out", victim[0], out)
            if out is not None and out.swapped:
                self.swapped.append(victim)
            else:
                self.note("preempt", victim[0], kv.free(victim[0]))
                victim[4] = 0
                self.waiting.append(tuple(victim[:4]))
            grant = kv.allocate(rid, end)
            self.note("grow", rid, grant)
        if not grant.granted:  # alone and still short: cannot happen with these sizes
            raise AssertionError(f"{rid} cannot grow to {end} tokens")


def run_here(num_requests: int, scenarios: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in scenarios:
        if name == "pool":
            out[name] = {"s": pool_only(5 * num_requests, record=False)[0]}
            digest = hashlib.sha256(pool_only(5 * num_requests, record=True)[1].encode()).hexdigest()
            out[name]["checksum"] = f"{pool_only_decisions(5 * num_requests)} {digest}"
            continue
        driver = Driver(name, num_requests, record=False)
        start = time.process_time()  # CPU time: steadier than wall time on a shared machine
        driver.run()
        seconds = time.process_time() - start
        out[name] = {"s": seconds, "checksum": Driver(name, num_requests, record=True).run()}
    return out


def _in_process(num_requests: int, scenarios: list[str], src: Path | None) -> dict[str, dict[str, Any]]:
    cmd = [sys.executable, __file__, "--in-process", "--requests", str(num_requests),
           "--scenarios", ",".join(scenarios)]  # fmt: skip
    result: dict[str, dict[str, Any]] = run_side(cmd, src, "kv_pool_speed")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000, help="requests per scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--baseline", default="HEAD", metavar="REF", help="git commit to compare with")
    parser.add_argument("--in-process", action="store_true", help="(internal) run here and print JSON")
    parser.add_argument("--json-out", default="kv_pool_speed.json")
    args = parser.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    if args.in_process:
        print(json.dumps(run_here(args.requests, scenarios)))
        return
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {"ours": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_src(args.baseline, Path(tmp))
        run: Callable[[Path | None], dict[str, dict[str, Any]]] = lambda src: _in_process(  # noqa: E731
            args.requests, scenarios, src
        )
        for rep in range(args.reps):
            runs["ours"].append(run(None))
            runs["baseline"].append(run(exported))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    table: dict[str, dict[str, Any]] = {}
    for name in scenarios:
        ours = [r[name]["s"] for r in runs["ours"]]
        base = [r[name]["s"] for r in runs["baseline"]]
        sums = [r[name]["checksum"].split() for r in runs["ours"] + runs["baseline"]]
        table[name] = {
            "ours_s": statistics.median(ours),
            "baseline_s": statistics.median(base),
            "speedup": statistics.median(b / o for o, b in zip(ours, base, strict=True)),
            "same_decisions": len({d for d, _ in sums}) == 1,
            "same_block_ids": len({i for _, i in sums}) == 1,
        }
    header = ["scenario", "requests", "baseline_s", "ours_s", "speedup", "same_decisions", "same_block_ids"]
    rows = [header] + [
        [n, f"{args.requests:,}", f"{t['baseline_s']:.3f}", f"{t['ours_s']:.3f}", f"{t['speedup']:.2f}x",
         "yes" if t["same_decisions"] else "NO", "yes" if t["same_block_ids"] else "no"]
        for n, t in table.items()
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows))
    print(f"baseline: {args.baseline}; speedup = baseline time / ours, median of {args.reps} paired runs")
    machine = {"python": platform.python_version(), "machine": platform.machine()}
    doc = {**machine, "args": vars(args), "table": table, "runs": runs}
    Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
    if not all(t["same_decisions"] for t in table.values()):
        print("decisions differ from the baseline's (see the docstring: the free list's order)", file=sys.stderr)


if __name__ == "__main__":
    main()
