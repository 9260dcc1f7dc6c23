"""What the benchmarks measured against a baseline commit share: that commit's `src` exported with
`git archive`, and one run of a child process on either side (this checkout's code, or the
exported `src` on PYTHONPATH) that prints its result as JSON on its last line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent


def export_src(commit: str, into: Path) -> Path:
    """`git archive COMMIT src` extracted into `into`; the exported `src` directory. SystemExit
    with git's reason when the commit cannot be exported."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {commit}: git archive failed: {archive.stderr.decode().strip()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def build_compiled(src: Path) -> str:
    """Build the compiled core of the exported `src` (a commit that has one: `contbatch.compiled_build`)
    in place, as `make compiled` does in a checkout; which core that side will run, in words.
    SystemExit when it cannot be built."""
    cmd = [sys.executable, "-m", "contbatch.compiled_build"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=side_env(src))
    status = subprocess.run([*cmd, "--status"], capture_output=True, text=True, check=False, env=side_env(src))
    if done.returncode or status.returncode or not status.stdout.startswith("compiled"):
        why = (done.stderr.strip() or status.stdout.strip() or "(no message)").splitlines()[-1]
        raise SystemExit(f"the baseline's compiled core could not be built: {why}")
    return status.stdout.strip()


def side_env(src: Path | None) -> dict[str, str]:
    """This environment for a child that imports this checkout's code (`src` None: no PYTHONPATH)
    or the exported `src`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def run_side(cmd: list[str], src: Path | None, name: str) -> Any:
    """The JSON that `cmd` prints last, run on this checkout's code (`src` None) or on `src`;
    SystemExit naming the side that failed and its last line of stderr."""
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=side_env(src))
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        sys.exit(f"{name}: the run failed on {'this working tree' if src is None else 'the baseline'}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_or_work(
    parser: argparse.ArgumentParser, worker: Callable[[argparse.Namespace], Any]
) -> argparse.Namespace | None:
    """Parse the command line, with the hidden ``--worker`` flag that `run_side`'s child is given:
    in that child, print `worker(args)` as the JSON line `run_side` reads and return None; in
    the parent, the arguments."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        return args
    print(json.dumps(worker(args)))
    return None


def alternating(commit: str, reps: int, run: Callable[[Path, str], T]) -> dict[str, list[T]]:
    """`run(src, side)` `reps` times for each side, "baseline" (`commit`'s exported `src`) and
    "current" (this checkout's `src`), the order alternating between repetitions: each side's
    results in order."""
    runs: dict[str, list[T]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {"baseline": export_src(commit, Path(tmp)), "current": ROOT / "src"}
        for rep in range(reps):
            for side in ("baseline", "current") if rep % 2 == 0 else ("current", "baseline"):
                runs[side].append(run(srcs[side], side))
                print(f"rep {rep + 1}/{reps} {side} done", file=sys.stderr)
    return runs
