"""Simulator and gateway agree: `contbatch bench` through `contbatch route` to four
`contbatch serve --backend sim` replicas reproduces the offline cluster simulation
(`simulate_cluster`) of the same trace and router within 5 % on mean TTFT, TPOT and E2E, for
`round_robin` and `least_outstanding` (issue 16, item 6).

Every part is its own process, as deployed: four replicas, one gateway per router, the bench in
the test process. The workload is sized so that what HTTP adds is small against what is
measured: steps of 80 ms or more, prompts of 128 to 512 tokens at 2 ms a token of prefill, and
a fleet loaded past what it serves (48 requests at 8 a second, four running at most per
replica), so that requests queue and their mean TTFT is about 4 s. Each hop adds a few
milliseconds on a quiet machine and more when two busy loops share its two cores with the nine
processes here (measured, two busy loops: mean TTFT +0.6 % to +1.6 % in two runs; at half these
times, steps of 40 ms at 16 req/s, one such run missed 5 % by 5 points: +9.9 %); a request that
reaches a replica late may miss a step boundary, which the queue absorbs, and least-outstanding
decisions taken a little apart from the simulator's may differ, which a loaded fleet evens out.
The replicas are shared by both routers; each run sends other prompt words (another `--seed`),
so the second finds nothing of the first in the prefix cache. Nothing else about wall time is
asserted.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from contbatch.bench.servers import ServerProcess, contbatch_argv, free_port, start_server
from contbatch.cli.main import main
from contbatch.cli.options import scheduler_config
from contbatch.sim import parse_cost
from contbatch.sim.cluster import simulate_cluster
from contbatch.sim.cluster_build import build_fleet
from contbatch.traces import synthetic, write_jsonl
from gateway.harness import metric_values

COST = "affine:base_ms=80,prefill_ms=2"
SETS = ["max_num_seqs=4"]
REPLICAS = 4
ROUTERS = ("round_robin", "least_outstanding")
KEYS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")


def spawn(stack: contextlib.ExitStack, args: list[str]) -> ServerProcess:
    """Start `contbatch ARGS` (not waiting for it), stopped when `stack` closes."""
    port = free_port()
    server = start_server(contbatch_argv(*args, port=port), port)
    stack.callback(server.stop)
    return server


@pytest.fixture
def fleet() -> Iterator[tuple[list[str], dict[str, str]]]:
    """Four sim replicas, then one gateway per router in front of them (named replica-0..3, the
    simulator's replica ids); each group started together, then waited for."""
    with contextlib.ExitStack() as stack:
        replicas = [spawn(stack, ["serve", "--backend", "sim", "--cost", COST, "--model", "sim",
                                  *(x for s in SETS for x in ("--set", s))]) for _ in range(REPLICAS)]  # fmt: skip
        for server in replicas:
            server.wait_healthy(90)
        backends = [server.url for server in replicas]
        named = [x for i, url in enumerate(backends) for x in ("--backend", f"replica-{i}={url}")]
        gateways = {router: spawn(stack, ["route", "--router", router, *named]) for router in ROUTERS}
        for server in gateways.values():
            server.wait_healthy(90)
        yield backends, {router: server.url for router, server in gateways.items()}


@pytest.mark.slow
def test_bench_through_the_gateway_reproduces_the_cluster_simulation(
    fleet: tuple[list[str], dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, gateways = fleet
    trace = synthetic.generate(
        "fleet", 48, synthetic.poisson(8.0), synthetic.uniform(128, 512), synthetic.uniform(16, 48), seed=3
    )
    path = tmp_path / "fleet.jsonl"
    write_jsonl(trace, path)
    cost = parse_cost(COST)
    config = scheduler_config("engine", cost, SETS)
    rows = []
    for seed, router in enumerate(ROUTERS, start=1):
        offline = simulate_cluster(trace, build_fleet({"replicas": REPLICAS, "router": router}, cost=cost,
                                                      config=config)).summary()  # fmt: skip
        code = main(["bench", "--base-url", gateways[router], "--model", "sim", "--trace", str(path),
                     "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                     "--result-filename", f"{router}.json", "--ignore-eos", "--continuous-usage-stats"])  # fmt: skip
        capsys.readouterr()
        assert code == 0
        online = json.loads((tmp_path / f"{router}.json").read_text())
        assert online["completed"] == offline["completed"] == len(trace)
        assert online["total_output_tokens"] == offline["total_output_tokens"]
        assert online["total_input_tokens"] == offline["total_input_tokens"]
        values = metric_values(httpx.get(gateways[router] + "/metrics").text)
        routed = [values[("contbatch:gateway_requests_routed_total", (("backend", f"replica-{i}"),))]
                  for i in range(REPLICAS)]  # fmt: skip
        assert sum(routed) == len(trace)  # no retries, no errors
        if router == "round_robin":
            assert routed == [len(trace) / REPLICAS] * REPLICAS
        rows.append((router, offline, online))
    with capsys.disabled():  # the numbers docs/fleets.md quotes (run with -s to see them)
        print(f"\n{'router':18s} {'metric':13s} {'simulated':>10s} {'gateway':>10s} {'diff':>8s}")
        for router, offline, online in rows:
            for key in KEYS:
                diff = 100 * (online[key] / offline[key] - 1)
                print(f"{router:18s} {key:13s} {offline[key]:10.1f} {online[key]:10.1f} {diff:+7.2f}%")
    for router, offline, online in rows:
        for key in KEYS:
            assert online[key] == pytest.approx(offline[key], rel=0.05), (router, key, online[key], offline[key])
