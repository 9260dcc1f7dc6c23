"""Figures of fleets (`contbatch.sim.cluster`): per-replica load and KV usage over time, replica
counts over time, and cost against goodput.

They take plain records, so this module needs nothing from the simulator:

- load points ``(ts, replica_id, pool, state, num_running, num_waiting, kv_usage)`` (the
  cluster's `LoadPoint`s, one per replica per sample);
- pool points ``(ts, pool, num_ready, num_provisioning, num_draining)`` (its `PoolPoint`s, one
  per change);
- cost points ``(label, price per hour, goodput, meets the SLO)`` (one per fleet a plan tried).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contbatch.plots._figure import axes_list, new_figure, run_color, save, style_time_axis, time_label


def plot_fleet_load(
    points: Sequence[Sequence[Any]], out_dir: str | Path, *, time_unit: str, stem: str = "fleet-load"
) -> tuple[Path, Path]:
    """Requests on each replica (running + waiting) and its KV usage against time, one line per
    replica, coloured by pool."""
    if not points:
        raise ValueError("plot_fleet_load needs at least one load point")
    series: dict[str, tuple[str, list[float], list[float], list[float]]] = {}
    for ts, replica, pool, _state, running, waiting, kv in points:
        entry = series.setdefault(str(replica), (str(pool), [], [], []))
        entry[1].append(float(ts))
        entry[2].append(float(running) + float(waiting))
        entry[3].append(100.0 * float(kv))
    pools = list(dict.fromkeys(entry[0] for entry in series.values()))
    figure = new_figure(10.0, 6.0)
    load_ax, kv_ax = axes_list(figure.subplots(2, 1, sharex=True, squeeze=False))
    labelled: set[str] = set()
    for pool, xs, loads, kvs in series.values():
        color = run_color(pools.index(pool))
        label = pool if pool not in labelled else None
        labelled.add(pool)
        load_ax.step(xs, loads, where="post", color=color, linewidth=0.9, alpha=0.75, label=label)
        kv_ax.step(xs, kvs, where="post", color=color, linewidth=0.9, alpha=0.75)
    load_ax.set_ylabel("requests per replica\n(running + waiting)", fontsize=9)
    kv_ax.set_ylabel("KV blocks in use (%)", fontsize=9)
    kv_ax.set_ylim(0, 105)
    for ax in (load_ax, kv_ax):
        ax.grid(alpha=0.35, linewidth=0.6)
        ax.set_ylim(bottom=0)
    load_ax.legend(fontsize=8, loc="upper right", title="pool")
    kv_ax.set_xlabel(time_label(time_unit))
    style_time_axis(kv_ax, time_unit)
    return save(figure, out_dir, stem)


def plot_replica_count(
    points: Sequence[Sequence[Any]], out_dir: str | Path, *, time_unit: str, stem: str = "fleet-replicas"
) -> tuple[Path, Path]:
    """Ready replicas (solid) and ready + provisioning (dashed) per pool against time."""
    if not points:
        raise ValueError("plot_replica_count needs at least one pool point")
    pools: dict[str, tuple[list[float], list[int], list[int]]] = {}
    for ts, pool, ready, provisioning, draining in points:
        entry = pools.setdefault(str(pool), ([], [], []))
        entry[0].append(float(ts))
        entry[1].append(int(ready) + int(draining))
        entry[2].append(int(ready) + int(draining) + int(provisioning))
    figure = new_figure(10.0, 3.6)
    ax = figure.subplots()
    for i, (pool, (xs, serving, billed)) in enumerate(pools.items()):
        ax.step(xs, serving, where="post", color=run_color(i), linewidth=1.6, label=f"{pool}: serving")
        ax.step(xs, billed, where="post", color=run_color(i), linewidth=1.0, linestyle="--",
                label=f"{pool}: with provisioning")  # fmt: skip
    ax.set_ylabel("replicas", fontsize=9)
    ax.set_ylim(bottom=0)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.35, linewidth=0.6)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xlabel(time_label(time_unit))
    style_time_axis(ax, time_unit)
    return save(figure, out_dir, stem)


def plot_cost_goodput(
    points: Sequence[Sequence[Any]], out_dir: str | Path, *, stem: str = "cost-goodput"
) -> tuple[Path, Path]:
    """Goodput against price per hour, one point per fleet (filled: meets the SLO target), the
    fleets better than every cheaper one labelled."""
    if not points:
        raise ValueError("plot_cost_goodput needs at least one fleet")
    figure = new_figure(8.0, 5.0)
    ax = figure.subplots()
    best = float("-inf")  # labels on the frontier only: the fleets beating every cheaper one
    for label, price, goodput, passes in sorted(points, key=lambda p: (float(p[1]), -float(p[2]))):
        color = run_color(0 if passes else 3)
        ax.scatter([price], [goodput], color=color if passes else "none", edgecolors=color, s=36, zorder=3)
        if float(goodput) > best:
            best = float(goodput)
            ax.annotate(str(label), (price, goodput), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.scatter([], [], color=run_color(0), label="meets the target")
    ax.scatter([], [], color="none", edgecolors=run_color(3), label="misses it")
    ax.set_xlabel("price per hour")
    ax.set_ylabel("goodput (requests meeting the SLO per time unit)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.35, linewidth=0.6)
    ax.legend(fontsize=8, loc="lower right")
    return save(figure, out_dir, stem)
