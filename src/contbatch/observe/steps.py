"""A server's steps, read from the outside: the streamed chunks of an observed run, grouped by the
step that produced them.

A continuous-batching server emits one token per running request per step, all at the step's
end; the client sees them a delivery latency later, close together. So the run's chunk arrivals,
sorted, fall into clusters, one per step (`clusters`): a chunk starts a new cluster when its
request already has one in the current cluster or when it arrives more than `CLUSTER_GAP` of the
run's median chunk gap after the cluster's first. Two consecutive clusters that share a request
bracket exactly one step (that request ran through it), whose duration is the time between
their first arrivals (`timed_steps`).

A cluster that arrives within that window of the one before is a cluster of its own only because
a request has a chunk in both: no step is that short, so the client read both late, at once (a
stalled reader, a loaded machine). Its arrival, and the one before's, are not their steps' ends:
no step that begins or ends at either is timed (on a loaded 2-core machine, such steps read as
0.06 ms where 20 ms ran, and the one before as twice its length).

What ran in such a step is known from the outside when nothing was half-done in it: every member
of the cluster decoded one token at its known context (prompt + tokens before), except those
whose first token it is, which prefilled their whole prompt there (the step's tokens within the
server's token budget); and no request was pending (sent, no first token yet) that could have
had a chunk of its prompt computed in it. Steps where a chunk carried several tokens (a client
read two steps at once) are not timed. Each timed step is a `SchedulerOutput` (chunks included),
so every cost model prices it as the simulator would.

Use: the machine's speed during a run from its own steps (`step_totals`, the default speed
source of `validate --observed`: the method issue 18 found reliable for the engine, from the
outside).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from dataclasses import dataclass

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.observe.record import ObservedRequest, ObservedRun
from contbatch.sim.cost import CostModel
from contbatch.sim.costs.profile import Totals, kind_totals

CLUSTER_GAP = 0.3  # of the run's median chunk gap: arrivals closer than this to a cluster's first join it


@dataclass(frozen=True, slots=True)
class Cluster:
    """The chunks of one step, as the client saw them."""

    first_ts: float  # the earliest arrival
    members: dict[int, int]  # request index -> index of its chunk here
    clean: bool  # it came at its step's end: every chunk carried one token, none was read at once with a neighbour's


@dataclass(frozen=True, slots=True)
class ObservedStep:
    duration_s: float
    out: SchedulerOutput  # what ran in it


def clusters(run: ObservedRun) -> list[Cluster]:
    """The run's chunk arrivals grouped by step (module docstring), in time order."""
    events = sorted((ts, i, k) for i, r in enumerate(run.requests) for k, ts in enumerate(r.chunk_ts))
    gaps = [b - a for r in run.requests for a, b in zip(r.chunk_ts, r.chunk_ts[1:], strict=False)]
    window = CLUSTER_GAP * statistics.median(gaps) if gaps else 0.0
    found: list[tuple[float, dict[int, int], list[bool]]] = []
    for ts, i, k in events:
        one_token = run.requests[i].chunk_tokens[k] == 1
        if found and i not in found[-1][1] and ts - found[-1][0] <= window:
            found[-1][1][i] = k
            found[-1][2].append(one_token)
        else:
            found.append((ts, {i: k}, [one_token]))
    late = _read_together([ts for ts, _, _ in found], window)
    return [Cluster(ts, members, all(flags) and not late[j]) for j, (ts, members, flags) in enumerate(found)]


def _read_together(starts: list[float], window: float) -> list[bool]:
    """Per cluster (first arrivals `starts`, in time order): whether it was read late, at once with
    a neighbour: it, or the one after it, arrived within `window` of the one before (module
    docstring)."""
    together = [False, *(b - a <= window for a, b in itertools.pairwise(starts)), False]
    return [together[j] or together[j + 1] for j in range(len(starts))]


def timed_steps(run: ObservedRun, max_num_batched_tokens: int) -> list[ObservedStep]:
    """The steps of `run` whose duration and content are known from the outside (module docstring);
    every duration exceeds the cluster window, so it is > 0."""
    found = clusters(run)
    first_step, waits = _waits(run, found)
    emitted = [list(itertools.accumulate(r.chunk_tokens, initial=0)) for r in run.requests]  # tokens before each chunk
    steps = []
    for j in range(1, len(found)):
        before, cluster = found[j - 1], found[j]
        if waits[j] or not (before.clean and cluster.clean and before.members.keys() & cluster.members.keys()):
            continue
        if any(k == 0 and first_step[i] < j for i, k in cluster.members.items()):
            continue  # it waited through earlier steps: part of its prompt may have run in them
        chunks = [_chunk(run.requests[i], emitted[i][k]) for i, k in cluster.members.items()]
        if sum(c.num_new_tokens for c in chunks) > max_num_batched_tokens:
            continue  # a prompt was split over several steps: not all of it ran here
        steps.append(ObservedStep(cluster.first_ts - before.first_ts, build_output(j, chunks)))
    return steps


def _waits(run: ObservedRun, found: list[Cluster]) -> tuple[list[int], list[int]]:
    """(per request, the first step it could join: the first that starts after its send; per step
    j (from cluster j - 1 to cluster j), how many requests could have joined it and had their
    first token only after it)."""
    first_at = {i: j for j, c in enumerate(found) for i, k in c.members.items() if k == 0}
    starts = [c.first_ts for c in found]
    first_step = [bisect.bisect_right(starts, r.send_ts) + 1 for r in run.requests]
    delta = [0] * (len(found) + 1)
    for i, begin in enumerate(first_step):
        # without a chunk, a request ran unseen until it ended: no step in between is known
        first = first_at.get(i, bisect.bisect_right(starts, run.requests[i].end_ts) + 1)
        if begin < first:
            delta[begin] += 1
            delta[first] -= 1
    return first_step, list(itertools.accumulate(delta))


def _chunk(request: ObservedRequest, tokens_before: int) -> ScheduledChunk:
    """What `request` ran in the step of its chunk with `tokens_before` output tokens before it:
    its whole prompt (its first chunk), else one decode at the end of its sequence."""
    prompt = max(request.num_prompt_tokens, 1)
    if tokens_before == 0:
        return ScheduledChunk(request.request_id, 0, prompt, True, True)
    return ScheduledChunk(request.request_id, prompt + tokens_before - 1, 1, False, True)


def step_totals(run: ObservedRun, cost: CostModel, max_num_batched_tokens: int) -> Totals:
    """`kind_totals` of the run's timed steps: what `speeds_by_kind` and `whole_speed` turn into
    the machine's speed during the run."""
    return kind_totals(((1000.0 * s.duration_s, s.out) for s in timed_steps(run, max_num_batched_tokens)), cost)
