"""/metrics: every family from the start, finishes counted by their real reason, prefix cache
counters, step and request failures (each finish reason moves its own counter, and only it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from contbatch.core.outputs import SchedulerOutput, StepResult
from contbatch.loop.params import SamplingParams
from contbatch.server.backends.sim import PacedSimExecutor, SimBackend
from contbatch.server.metrics import FAILURE_STAGES, REJECT_KINDS, failure_stage
from contbatch.server.types import Submission
from server.harness import MODEL, RunningServer, sim_backend

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
P = "contbatch:"
COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "request_cancelled",
    "request_timeout",
    "padding_tokens",
    "num_steps",
    "num_failed_steps",
    "num_preemptions",
    "num_recomputed_tokens",
    "unsent_tokens",
    "num_pause_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_paused", "kv_cache_usage_perc")
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "step_duration_seconds",
)
POISON_SEED = 666  # a step holding a request with this seed fails (the executor)
POISON_TOKEN = 31_999  # decoding a window that holds this prompt token fails (output processing)


def samples(server: RunningServer) -> Samples:
    values: Samples = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def every_series() -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    series = [(P + name + "_total", ()) for name in COUNTERS]
    series += [(P + name, ()) for name in GAUGES]
    series += [(P + name + suffix, ()) for name in HISTOGRAMS for suffix in ("_count", "_sum")]
    series += [(P + "request_success_total", (("finished_reason", r),)) for r in ("length", "stop")]
    series += [(P + "request_rejected_total", (("reason", kind),)) for kind in REJECT_KINDS]
    series += [(P + "request_failed_total", (("stage", stage),)) for stage in FAILURE_STAGES]
    return series


def finishes(m: Samples) -> dict[str, float]:
    """Finished requests by outcome, from the metrics (each family summed over its labels)."""
    out = {"length": 0.0, "stop": 0.0, "cancelled": 0.0, "timeout": 0.0, "rejected": 0.0, "error": 0.0}
    for (name, labels), value in m.items():
        if name == P + "request_success_total":
            out[dict(labels)["finished_reason"]] += value
        elif name == P + "request_cancelled_total":
            out["cancelled"] += value
        elif name == P + "request_timeout_total":
            out["timeout"] += value
        elif name == P + "request_rejected_total":
            out["rejected"] += value
        elif name == P + "request_failed_total":
            out["error"] += value
    return out


def completion(server: RunningServer, **fields: Any) -> httpx.Response:
    return server.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 3, **fields})


def test_a_fresh_server_exports_every_family_at_zero(server: RunningServer) -> None:
    m = samples(server)
    missing = [s for s in every_series() if s not in m]
    assert not missing, missing
    nonzero = {s: m[s] for s in every_series() if m[s] != 0}
    assert not nonzero, nonzero
    assert set(finishes(m).values()) == {0.0}


def test_length_stop_and_cancelled_move_their_own_counters(server: RunningServer) -> None:
    r = completion(server, ignore_eos=True)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    r = completion(server, max_tokens=6, ignore_eos=True, stop=["tok tok"])  # the sim's text: " tok tok ..."
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    body = {"model": MODEL, "prompt": "a b c d", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                break  # one token read, then the client leaves
    server.wait_idle()
    m = samples(server)
    assert finishes(m) == {"length": 1, "stop": 1, "cancelled": 1, "timeout": 0, "rejected": 0, "error": 0}
    assert m[(P + "prompt_tokens_total", ())] == 3 + 3 + 4
    generated = m[(P + "generation_tokens_total", ())]
    assert generated >= 3 + 2 + 1
    assert m[(P + "time_to_first_token_seconds_count", ())] == 3
    assert m[(P + "e2e_request_latency_seconds_count", ())] == 3
    assert m[(P + "num_steps_total", ())] >= 3 and m[(P + "step_duration_seconds_count", ())] >= 3
    assert m[(P + "num_failed_steps_total", ())] == 0


def test_timeouts_move_their_own_counter(make_server: Any) -> None:
    server: RunningServer = make_server(cost="affine:base_ms=10", overrides={"lifecycle": {"request_timeout": 0.3}})
    assert completion(server, max_tokens=50, ignore_eos=True).status_code == 504  # 50 steps of 10 ms > 0.3 s
    assert completion(server, max_tokens=2, ignore_eos=True).status_code == 200
    server.wait_idle()
    m = samples(server)
    assert finishes(m) == {"length": 1, "stop": 0, "cancelled": 0, "timeout": 1, "rejected": 0, "error": 0}
    assert m[(P + "prompt_tokens_total", ())] == 3 + 3
    assert m[(P + "e2e_request_latency_seconds_count", ())] == 2
    assert m[(P + "unsent_tokens_total", ())] >= 0


def test_queue_full_rejections_match_the_429s(make_server: Any) -> None:
    """A one-seat server with a one-request queue under 8 concurrent requests: each 429 counts
    once as queue_full, each 200 once as length."""
    server: RunningServer = make_server(
        cost="affine:base_ms=10", overrides={"max_num_seqs": 1, "lifecycle": {"max_waiting": 1}}
    )
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: completion(server, max_tokens=20, ignore_eos=True).status_code, range(8)))
    server.wait_idle()
    assert set(codes) == {200, 429}, codes
    m = samples(server)
    got = finishes(m)
    assert got["length"] == codes.count(200)
    assert got["rejected"] == m[(P + "request_rejected_total", (("reason", "queue_full"),))] == codes.count(429)
    assert sum(got.values()) == len(codes)


class _PoisonExecutor(PacedSimExecutor):
    """Fails every step that holds a request submitted with `POISON_SEED`."""

    def __init__(self, inner: PacedSimExecutor) -> None:
        super().__init__(inner.cost)
        self.poisoned: set[str] = set()

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.poisoned |= {new.request_id for new in out.new_requests if new.params.seed == POISON_SEED}
        if any(c.request_id in self.poisoned for c in out.chunks):
            raise RuntimeError("simulated device fault")
        return super().execute(out)


class _PoisonDecoder:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if POISON_TOKEN in token_ids:
            raise UnicodeError("simulated detokenizer fault")
        return str(self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens))


def poisoned_backend() -> SimBackend:
    backend = sim_backend("affine:base_ms=5")
    backend.executor = _PoisonExecutor(backend.executor)
    backend.decoder = _PoisonDecoder(backend.decoder)
    return backend


def test_failed_requests_are_counted_by_stage_and_failed_steps_too(make_server: Any) -> None:
    server: RunningServer = make_server(backend=poisoned_backend())
    assert completion(server, seed=POISON_SEED).status_code == 500  # its step fails
    # its text fails (ignore_eos: the sim would end it with its first token, and the scheduler's STOP would win)
    assert completion(server, prompt=[5, POISON_TOKEN, 7], ignore_eos=True).status_code == 500
    assert completion(server).status_code == 200  # the server keeps serving
    server.wait_idle()
    m = samples(server)
    assert finishes(m) == {"length": 1, "stop": 0, "cancelled": 0, "timeout": 0, "rejected": 0, "error": 2}
    assert m[(P + "request_failed_total", (("stage", "step"),))] == 1
    assert m[(P + "request_failed_total", (("stage", "output"),))] == 1
    assert m[(P + "num_failed_steps_total", ())] == 1


def test_failure_stages_follow_the_loops_wording() -> None:
    assert failure_stage("the executor failed in step 3: RuntimeError: boom") == "step"
    assert failure_stage("its output could not be processed: UnicodeError: x") == "output"
    assert failure_stage("internal error: KeyError: 'r1'") == "internal"
    assert failure_stage("") == failure_stage("something new") == "other"


def test_submissions_the_driver_refuses_count_as_rejected(server: RunningServer) -> None:
    """Refused before the scheduler saw them (an empty prompt, a duplicate id): counted by kind."""

    async def submit_all() -> list[str]:
        params = SamplingParams(max_tokens=2)
        now = server.client.now()
        streams = [
            server.client.generate(Submission("empty", (), params, now)),
            server.client.generate(Submission("twice", (1, 2), params, now)),
            server.client.generate(Submission("twice", (1, 2), params, now)),
        ]
        finals = []
        for stream in streams:
            async for _ in stream:
                pass
            assert stream.final is not None
            finals.append(stream.final.reject_kind or stream.final.finish_reason.value)  # type: ignore[union-attr]
        return finals

    kinds = asyncio.run(submit_all())
    assert sorted(kinds) == ["duplicate_id", "invalid", "length"], kinds
    server.wait_idle()
    m = samples(server)
    assert m[(P + "request_rejected_total", (("reason", "invalid"),))] == 1
    assert m[(P + "request_rejected_total", (("reason", "duplicate_id"),))] == 1
    assert finishes(m)["rejected"] == 2 and finishes(m)["length"] == 1


def test_prefix_cache_counters_move_with_a_repeated_prompt(make_server: Any) -> None:
    server: RunningServer = make_server(overrides={"kv": {"enable_prefix_caching": True, "block_size": 16}})
    prompt = " ".join(f"w{i}" for i in range(64))  # 64 tokens: 4 full blocks
    assert completion(server, prompt=prompt, max_tokens=2).status_code == 200
    server.wait_idle()
    m = samples(server)
    assert m[(P + "prefix_cache_queries_total", ())] == 64 and m[(P + "prefix_cache_hits_total", ())] == 0
    assert completion(server, prompt=prompt, max_tokens=2).status_code == 200
    server.wait_idle()
    m = samples(server)
    hits = m[(P + "prefix_cache_hits_total", ())]
    assert m[(P + "prefix_cache_queries_total", ())] == 128
    assert 48 <= hits < 64, hits  # at least the whole blocks; the last prompt token is always computed


def test_counters_only_grow_under_concurrent_scrapes(server: RunningServer) -> None:
    """Scrapes while requests run: every scrape parses, and the token counter never goes back."""
    stop = threading.Event()
    seen: list[float] = []

    def scrape() -> None:
        while not stop.is_set():
            seen.append(samples(server)[(P + "generation_tokens_total", ())])

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for _ in range(3):
            assert completion(server, max_tokens=4, ignore_eos=True).status_code == 200
    finally:
        stop.set()
        thread.join()
    assert seen == sorted(seen)
