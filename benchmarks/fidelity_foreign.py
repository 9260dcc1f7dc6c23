"""Predict servers from the outside: observe -> fit -> validate --observed, one table.

    .venv/bin/python benchmarks/fidelity_foreign.py [--targets engine,transformers] [--replays 3]

For each target server, started here on 127.0.0.1 and treated as a black box (only its HTTP
answers are read):

- ``engine``: `contbatch serve --backend engine` on the demo model (fit with ``--server contbatch``);
- ``transformers``: `transformers serve --continuous-batching` on the same demo checkpoint
  (``--cb-num-blocks`` and ``--cb-max-batch-tokens`` given, so the preset's unknowns are known;
  fit with ``--server transformers-cb`` and those two as ``--set``), skipped when transformers
  cannot serve here.

1. `contbatch observe` with the probe plan (prefill grid, decode sweep, a saturation run that
   measures the capacity, open runs at 30 % and 70 % of it): the fitting observation;
2. `contbatch fit` on it (its default method: the step terms from the server's steps read from
   the streamed chunks, then the delivery);
3. `--replays` held-out observations: open runs only, at 50 % and 85 % of the capacity measured
   in step 1 (other rates, other arrival draws: never fitted on), each replay with its own seed
   (its own prompts: a server's prefix cache must not serve one replay from another's), each
   with the speed probe around every run;
4. `contbatch validate --observed` on them: per load, each metric's row is the replay of median
   error, each replay predicted at the machine speeds its own timed steps ran at, decode-only
   steps and steps with a prefill apart (issue 18's method, from the outside); the same under
   the other speed sources (``steps``: one speed, ``probe``, ``calibration``: the fit's speed) is
   in the JSON.

Prints one table (|error| of mean and p90 TTFT, TPOT and E2E per target and load, against the
issue's bounds: 10 % on means, 15 % on p90) and writes everything to
``benchmarks/results/fidelity_foreign.json`` (``--json-out``). Every run is reported: the
observation files and the profiles stay in ``--work-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from contbatch.bench.servers import (
    TRANSFORMERS_OFFLINE_ENV,
    contbatch_argv,
    free_port,
    running_server,
    transformers_serve_argv,
    transformers_serve_missing,
)
from contbatch.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
LOADS = ("0.50", "0.85")
KEYS = {
    "mean_ttft_ms": ("TTFT mean", 0.10),
    "p90_ttft_ms": ("TTFT p90", 0.15),
    "mean_tpot_ms": ("TPOT mean", 0.10),
    "p90_tpot_ms": ("TPOT p90", 0.15),
    "mean_e2el_ms": ("E2E mean", 0.10),
    "p90_e2el_ms": ("E2E p90", 0.15),
}
SHAPE = ["--open-prompt", "32,384", "--open-output", "16,96", "--open-requests", "30"]
PROBE_PLAN = ["--prompt-lengths", "16,128,384", "--concurrency", "1,4,16", "--long-prompt", "384",
              "--long-concurrency", "1,8", "--decode-output", "64", "--open-rates", "0.3,0.7", *SHAPE]  # fmt: skip
TF_BLOCKS, TF_BATCH_TOKENS = 64, 512
OTHER_SPEED_SOURCES = ("steps", "probe", "calibration")  # reported beside the default (step-kinds)


FIT_FLAGS = {
    "engine": ["--server", "contbatch"],
    "transformers": ["--server", "transformers-cb", "--set", f"kv.num_blocks={TF_BLOCKS}",
                     "--set", f"max_num_batched_tokens={TF_BATCH_TOKENS}"],
}  # fmt: skip


def targets(names: list[str], work: Path) -> Iterator[tuple[str, Any]]:
    """(name, a context manager serving it) per target."""
    from contbatch.engine.demo import ensure_demo_model

    model = ensure_demo_model()
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for name in names:
        port = free_port()
        if name == "engine":
            argv = contbatch_argv("serve", "--backend", "engine", "--model", str(model), port=port)
            served = running_server(argv, port, env=threads, log=work / "engine.log", start_s=300)
            yield name, served
        elif name == "transformers":
            why = transformers_serve_missing()
            if why:
                print(f"transformers: skipped ({why})", file=sys.stderr)
                continue
            argv = transformers_serve_argv(
                str(model), port=port, num_blocks=TF_BLOCKS, max_batch_tokens=TF_BATCH_TOKENS
            )
            env = {**threads, **TRANSFORMERS_OFFLINE_ENV}
            yield name, running_server(argv, port, env=env, log=work / "transformers.log", start_s=300)
        else:
            raise SystemExit(f"unknown target {name!r}; known: engine, transformers")


def cli(*argv: str) -> str:
    """`contbatch ARGV` in this process; its stdout (an exit code other than 0 stops the benchmark)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    if code != 0:
        raise SystemExit(f"contbatch {' '.join(argv)} exited {code}")
    return out.getvalue()


def one_target(name: str, server: Any, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Observe `name` through `server` (None: take the observations already in `work`), fit, validate."""
    if server is None:
        held_out = [work / f"{name}-heldout-{i}.jsonl" for i in range(args.replays)]
        return analyse(name, work / f"{name}-fit.jsonl", held_out, work, observed_s=0.0)
    with server as served:
        url = served.url
        fitted = work / f"{name}-fit.jsonl"
        started = time.monotonic()
        cli("observe", "--url", url, "--out", str(fitted), "--budget-s", str(args.budget_s), *PROBE_PLAN)
        capacity = json.loads(fitted.read_text().splitlines()[0])["capacity_rps"]
        held_out = []
        for i in range(args.replays):
            path = work / f"{name}-heldout-{i}.jsonl"
            seed = str(7 + 10 * i)  # each replay its own prompts: a prefix cache must not serve one from another
            cli("observe", "--url", url, "--out", str(path), "--phases", "open", "--open-rates", ",".join(LOADS),
                "--capacity", str(capacity), "--seed", seed, "--budget-s", str(args.budget_s), *SHAPE)  # fmt: skip
            held_out.append(path)
        observed_s = time.monotonic() - started
    return analyse(name, fitted, held_out, work, observed_s)


def analyse(name: str, fitted: Path, held_out: list[Path], work: Path, observed_s: float) -> dict[str, Any]:
    """`contbatch fit` on `fitted`, `contbatch validate --observed` on `held_out`: the target's result."""
    capacity = json.loads(fitted.read_text().splitlines()[0])["capacity_rps"]
    profile = work / f"{name}-profile.json"
    fit = json.loads(cli("fit", "--observed", str(fitted), *FIT_FLAGS[name], "--out", str(profile), "--json"))
    observed_flags = [flag for path in held_out for flag in ("--observed", str(path))]
    plots = work / "plots" / name
    validation = json.loads(cli("validate", *observed_flags, "--profile", str(profile), "--plot", str(plots), "--json"))
    by_source = {source: json.loads(cli("validate", *observed_flags, "--profile", str(profile), "--speed-source",
                                        source, "--json")) for source in OTHER_SPEED_SOURCES}  # fmt: skip
    return {"target": name, "capacity_rps": capacity, "observe_s": observed_s, "fit": fit,
            "validation": validation, "validation_by_speed_source": by_source,
            "files": [str(fitted), *map(str, held_out), str(profile)]}  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    header = f"{'target':<13}{'load':>6}" + "".join(f"{label:>11}" for label, _ in KEYS.values())
    lines = [header, "-" * len(header)]
    for result in results:
        for run in result["validation"]["runs"]:
            cells = []
            for key, (_, bound) in KEYS.items():
                error = run["metrics"][key]["rel_error"]
                cells.append(f"{100 * error:+.1f}%{'' if abs(error) <= bound else '!'}".rjust(11))
            load = run["run"].removeprefix("open-")
            lines.append(f"{result['target']:<13}{load:>6}" + "".join(cells))
    lines.append("predicted / measured - 1 per metric (the replay of median error); ! beyond the bound "
                 "(10 % on means, 15 % on p90)")  # fmt: skip
    for result in results:
        t = result["fit"]
        terms = (f"{t['base_ms']:.3g} + {t['prefill_ms']:.3g} x prefill + {t['decode_ms']:.3g} x decode + "
                 f"{t['context_ms']:.3g} x context + {t.get('prefill_pair_ms', 0.0):.3g} x prefill pairs + "
                 f"{t.get('batch_pair_ms', 0.0):.3g} x batch pairs")  # fmt: skip
        lines.append(f"{result['target']}: capacity {result['capacity_rps']:.3g} req/s; step ms = {terms}; "
                     f"delivery {t['delivery_ms']:.3g} ms")  # fmt: skip
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="engine,transformers")
    parser.add_argument("--replays", type=int, default=3, help="held-out observations per target")
    parser.add_argument("--budget-s", type=float, default=400.0, help="per observation")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/contbatch-fidelity-foreign"))
    parser.add_argument("--reanalyse", action="store_true",
                        help="observe nothing: fit and validate the observations already in --work-dir")  # fmt: skip
    parser.add_argument("--json-out", type=Path, default=ROOT / "benchmarks" / "results" / "fidelity_foreign.json")
    return parser.parse_args()


def run() -> int:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(names) - set(FIT_FLAGS))
    if unknown:
        raise SystemExit(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(FIT_FLAGS)}")
    served = ((name, None) for name in names) if args.reanalyse else targets(names, args.work_dir)
    for name, server in served:
        print(f"{name}: {'re-analysing' if server is None else 'observing'} ...", file=sys.stderr, flush=True)
        results.append(one_target(name, server, args.work_dir, args))
    text = table(results)
    print(text)
    document = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "replays": args.replays,
                "loads": list(LOADS), "bounds": {k: b for k, (_, b) in KEYS.items()}, "table": text,
                "results": results}  # fmt: skip
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(run())
