"""The profile `contbatch fit` writes: a `contbatch-profile` file any ``--cost profile:PATH`` reads.

The ``cost`` object is the one `contbatch.sim.costs.profile` states, with the fitted affine terms
as its ``affine`` fit (``model``: ``affine``), no engine-loop correction (``loop_scale`` 1, loop
terms 0: from outside a server, the loop is part of each step's time) and the swap price of
`AffineCost`'s default (a probe plan never makes a server swap). The ``observed`` object is
what only `contbatch validate --observed` reads: the server preset and ``--set`` overrides the fit
simulated (so validation replays the same scheduler), the scheduler kind, ``delivery_ms`` (added
to every predicted chunk: it is no step's cost), the observation file, the objective, every
iteration and the residuals per run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contbatch.observe.fit import OBJECTIVE, FitResult
from contbatch.sim.costs.profile import PROFILE_FORMAT, PROFILE_VERSION, load_profile

OBSERVED_KEYS = ("server", "overrides", "scheduler", "delivery_ms")


def profile_document(
    result: FitResult,
    *,
    observation: str,
    target: Mapping[str, Any],
    server: str,
    overrides: Sequence[str],
    scheduler: str,
    config: Mapping[str, Any],
    runs: Sequence[str],
) -> dict[str, Any]:
    terms = result.terms
    cost = terms.cost()
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"hostname": platform.node(), "platform": platform.platform()},
        "cost": {
            "model": "affine",
            "loop_scale": 1.0,
            "prefill_loop_scale": None,
            "decode_loop_scales": [],
            "loop_base_ms": 0.0,
            "loop_request_ms": 0.0,
            "swap_ms_per_block": cost.swap_ms_per_block,
            "affine": {
                "base_ms": cost.base_ms,
                "prefill_ms": cost.prefill_ms,
                "decode_ms": cost.decode_ms,
                "context_ms": cost.context_ms,
                "prefill_pair_ms": cost.prefill_pair_ms,
                "batch_pair_ms": cost.batch_pair_ms,
            },
        },
        "chosen": "affine",
        "observed": {
            "observation": observation,
            "target": dict(target),
            "server": server,
            "overrides": list(overrides),
            "scheduler": scheduler,
            "scheduler_config": dict(config),
            "delivery_ms": terms.delivery_ms,
            "speed_reference_ms": result.speed_reference_ms,
            "run_speeds": dict(result.speeds),
            "runs": list(runs),
            "objective": OBJECTIVE,
            "objective_per_request": result.objective,
            "method": result.method,
            "timed_steps": result.num_timed_steps,
            "num_requests": result.num_requests,
            "iterations": list(result.iterations),
            "residuals": [r.as_dict() for r in result.residuals],
        },
    }


def write_profile(document: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")


def read_observed(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """(the `ProfileCost`, the ``observed`` object) of a profile `fit` wrote; ValueError (a
    `CostSpecError` for the cost part) naming the file and what is missing."""
    cost = load_profile(path)
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    observed = document.get("observed")
    if not isinstance(observed, dict) or any(key not in observed for key in OBSERVED_KEYS):
        raise ValueError(f"{os.fspath(path)}: no 'observed' object with {', '.join(OBSERVED_KEYS)}: "
                         "write the profile with contbatch fit")  # fmt: skip
    return cost, observed
