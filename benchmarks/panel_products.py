"""The engine's panel products (`gemm_panels`, the native kernels' matrix product against weights
packed into column panels): the working tree's kernels against a baseline commit's, and torch's
`F.linear`, on the demo model's products, in one run.

    .venv/bin/python benchmarks/panel_products.py --baseline COMMIT [--rows 1 8 32 2048]
        [--builds native avx2] [--reps 7] [--threads 2] [--json-out PATH]

Each side's `src/contbatch/engine/native/*.c` (the baseline's from `git archive`) is compiled with
the engine's `FLAGS`, once per build: `native` (for this CPU, what the engine runs here) and
`avx2` (the same with `-mno-avx512f`: the loops AVX2 machines run; only where this CPU has
AVX-512, else `native` is that build already). Each side packs its own weights with its own
`pack_panels`. A step reads every layer's weights once, so no product finds its weight in cache:
each shape is timed over as many distinct copies of its weight as fill --weight-mib (a time is
per product: a pass over the copies divided by their count). Per repetition the three (baseline,
current, torch) run in turn, the order rotating; the result is the median over --reps. The
current side's products must equal the baseline's bit for bit (`same_bits`; the script fails
otherwise). Wall time on this shared machine is noisy: the ratios within one run are the result.
Prints a table, writes JSON (--json-out).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_src import export_src

ROOT = Path(__file__).resolve().parent.parent
NATIVE = Path("contbatch/engine/native")
# the demo model's products (name: out_features, in_features): hidden 384, 6 heads of 64 (2 KV
# heads), intermediate 1,024, vocabulary 32,000
SHAPES = {"qkv": (640, 384), "o": (384, 384), "gate_up": (2048, 384), "down": (384, 1024), "lm_head": (32000, 384)}
BUILDS = {"native": (), "avx2": ("-mno-avx512f",)}
_P, _I = ctypes.c_void_p, ctypes.c_int64


def compile_kernels(native_dir: Path, extra: tuple[str, ...], out: Path) -> ctypes.CDLL:
    """The kernels of `native_dir` built as the engine builds them (its FLAGS) plus `extra`."""
    from contbatch.engine.native import FLAGS

    sources = sorted(str(p) for p in native_dir.glob("*.c"))
    cmd = [os.environ.get("CC") or "cc", *FLAGS, *extra, *sources, "-o", str(out), "-lm"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"cc failed for {native_dir}: {done.stderr.strip()[-300:]}")
    library = ctypes.CDLL(str(out))
    library.pack_panels.argtypes = [_P, _I, _I, _P]
    library.gemm_panels.argtypes = [_P, _I, _P, _P, _I, _I, _I, ctypes.c_int, _P]
    library.gemm_panels.restype = ctypes.c_int
    return library


def packed(library: ctypes.CDLL, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for w in weights:
        p = torch.empty(w.numel())
        library.pack_panels(w.data_ptr(), w.shape[0], w.shape[1], p.data_ptr())
        out.append(p)
    return out


def product_pass(library: ctypes.CDLL, x: torch.Tensor, panels: list[torch.Tensor], n: int, c: torch.Tensor) -> None:
    rows, k = x.shape
    threads = torch.get_num_threads()
    for p in panels:
        library.gemm_panels(x.data_ptr(), k, p.data_ptr(), c.data_ptr(), rows, n, k, threads, None)


def linear_pass(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for w in weights:
        F.linear(x, w)


def median_ms(runs: dict[str, Callable[[], None]], copies: int, reps: int) -> dict[str, float]:
    """Each run's median over `reps` of one pass's time per copy, the runs' order rotating."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        runs[name]()  # (warm: the libraries' pages, the threads)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - start) / copies * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(shape: str, rows: int, sides: dict[str, ctypes.CDLL], weight_mib: float, reps: int) -> dict[str, Any]:
    n, k = SHAPES[shape]
    copies = max(1, round(weight_mib * 2**20 / (4 * n * k)))
    torch.manual_seed(rows + n)
    weights = [torch.randn(n, k) * k**-0.5 for _ in range(copies)]
    x = torch.randn(rows, k)
    outs = {name: torch.empty(rows, n) for name in sides}
    panels = {name: packed(library, weights) for name, library in sides.items()}
    runs: dict[str, Callable[[], None]] = {
        name: (lambda lib=library, pn=panels[name], c=outs[name]: product_pass(lib, x, pn, n, c))
        for name, library in sides.items()
    }
    runs["torch"] = lambda: linear_pass(x, weights)
    ms = median_ms(runs, copies, reps)
    same = torch.equal(outs["baseline"], outs["current"])
    flop = 2 * rows * n * k
    return {
        "shape": shape,
        "rows": rows,
        "copies": copies,
        "ms": ms,
        "gflops": {name: flop / t / 1e6 for name, t in ms.items()},
        "speedup": ms["baseline"] / ms["current"],
        "vs_torch": ms["torch"] / ms["current"],
        "same_bits": same,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit compared against")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 2048])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--builds", nargs="+", choices=sorted(BUILDS), default=list(BUILDS))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weight-mib", type=float, default=64.0, help="distinct weights per shape (default 64 MiB)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if min(args.reps, args.threads, *args.rows) < 1 or not args.weight_mib > 0:
        parser.error("--reps, --threads and --rows must be >= 1, --weight-mib > 0")
    torch.set_num_threads(args.threads)
    has_avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    builds = [b for b in args.builds if b != "avx2" or has_avx512]
    results = []
    print(HEADER)
    with tempfile.TemporaryDirectory() as tmp:
        base_src = export_src(args.baseline, Path(tmp))
        for build in builds:
            sides = {
                side: compile_kernels(src / NATIVE, BUILDS[build], Path(tmp) / f"{side}-{build}.so")
                for side, src in (("baseline", base_src), ("current", ROOT / "src"))
            }
            for shape in args.shapes:
                for rows in args.rows:
                    row = {"build": build} | measure(shape, rows, sides, args.weight_mib, args.reps)
                    results.append(row)
                    print_row(row)
    if any(not r["same_bits"] for r in results):
        print("FAILED: the current kernels' products differ from the baseline's", file=sys.stderr)
    if args.json_out:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json_out.write_text(json.dumps({"config": config, "builds": builds, "results": results}, indent=1) + "\n")
        print(f"json: {args.json_out}")
    return 0 if all(r["same_bits"] for r in results) else 1


HEADER = "build  shape      rows  ms, GFLOP/s: baseline / current / torch          speedup  vs torch"


def print_row(row: dict[str, Any]) -> None:
    ms, gf = row["ms"], row["gflops"]
    sides = "  ".join(f"{ms[s]:7.3f} ({gf[s]:3.0f})" for s in ("baseline", "current", "torch"))
    bits = "" if row["same_bits"] else "  BITS DIFFER"
    ratios = f"{row['speedup']:6.2f}x  {row['vs_torch']:6.2f}x"
    print(f"{row['build']:<7}{row['shape']:<9}{row['rows']:>6}  {sides}  {ratios}{bits}")


if __name__ == "__main__":
    sys.exit(main())
