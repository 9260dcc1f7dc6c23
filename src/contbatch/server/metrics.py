"""Prometheus metrics of the server, named like vLLM's (``contbatch:`` instead of ``vllm:``).

Two sources, no callbacks sprinkled through the code:

- the driver's snapshot (`DriverSnapshot`, replaced after every step), read at scrape time by a
  collector: the gauges (running, waiting, paused requests, KV usage) and the counters the
  scheduler keeps (preemptions, padding waste, generated-but-unsent tokens, rejections, steps);
- the step loop's observer calls (a `contbatch.loop.StepObserver`), on the driver thread:
  `on_step` counts generated tokens and times the step, and
  `on_finished` observes the latency histograms from the finished request's timeline with the
  definitions of `contbatch.metrics.request` (one definition of TTFT, TPOT, ITL, E2E, queue time)
  and counts the request by finish reason; its prompt tokens and latencies count only when its
  prompt was processed (it was scheduled or emitted a token, as `contbatch.metrics.summarize`
  counts input tokens): a rejected request has no latency to observe.

``request_success_total`` carries every finish reason (length, stop, cancelled, timeout,
rejected, error) in its ``finished_reason`` label, so its sum is the number of finished requests.
Every metric has a ``model_name`` label. The registry is per server (no global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contbatch.core.request import Request
from contbatch.loop.observe import StepObserver, StepRecord
from contbatch.metrics.request import request_metrics
from contbatch.server.types import DriverSnapshot

# no *_created series (as vLLM): they would double every counter for no use here
disable_created_metrics()  # type: ignore[no-untyped-call]

PREFIX = "contbatch:"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# snapshot counters: (metric name without _total, help, SchedulerStats / snapshot key)
_STAT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("num_preemptions", "Preemptions (recompute or swap) of running requests.", "num_preemptions"),
    ("num_recomputed_tokens", "Prefill tokens computed again after a recompute preemption.", "num_recomputed_tokens"),
    (
        "unsent_tokens",
        "Generated-but-unsent tokens: produced for requests that ended before their client took them.",
        "num_unsent_tokens",
    ),
    (
        "num_pause_preemptions",
        "Running requests preempted because their client stopped reading.",
        "num_pause_preemptions",
    ),
)


class ServerMetrics(StepObserver):
    """The server's Prometheus registry; a step observer of the driver's loop."""

    def __init__(self, snapshot: Callable[[], DriverSnapshot], *, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of processed requests.", labels, registry=reg
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens generated.", labels, registry=reg)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=reg
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Gaps between consecutive token emissions of a request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", labels, buckets=REQUEST_BUCKETS, registry=reg
        )
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduled.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=reg,
        )
        self.step_time = Histogram(
            PREFIX + "step_duration_seconds", "Wall time of one step.", labels, buckets=STEP_BUCKETS, registry=reg
        )
        reg.register(_SnapshotCollector(snapshot, model_name))
        for reason in ("length", "stop", "cancelled", "timeout", "rejected", "error"):
            self.request_success.labels(model_name, reason)  # every reason shows, at 0 until it happens

    # -- StepObserver (the driver thread) -------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        if record.num_sampled_tokens:
            self.generation_tokens.labels(self.model_name).inc(record.num_sampled_tokens)
        self.step_time.labels(self.model_name).observe(record.end_ts - record.start_ts)

    def on_finished(self, request: Request) -> None:
        m = request_metrics(request.timeline)
        name = self.model_name
        self.request_success.labels(name, m.finish_reason.value).inc()
        if m.first_scheduled_ts is None and m.num_output_tokens == 0:
            return  # never ran (rejected, or cancelled / timed out while waiting): no latency to observe
        self.prompt_tokens.labels(name).inc(m.num_prompt_tokens)
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(name).observe(m.tpot)
        if m.queue_time is not None:
            self.queue.labels(name).observe(m.queue_time)
        itl = self.itl.labels(name)
        for gap in m.itl_per_emission:
            itl.observe(gap)
        self.e2e.labels(name).observe(m.e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """Gauges and scheduler counters, read from the driver's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], DriverSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        stats = snap.stats
        yield self._gauge("num_requests_running", "Requests in the running set.", snap.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting)
        yield self._gauge("num_requests_paused", "Running requests paused: their client has not read.", snap.num_paused)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", snap.kv_usage)
        yield self._counter(
            "padding_tokens", "Token-work computed for no request (padding waste).", snap.num_padding_tokens
        )
        yield self._counter("num_steps", "Steps run.", snap.num_steps)
        yield self._counter("num_failed_steps", "Steps whose executor raised.", snap.num_failed_steps)
        for name, doc, key in _STAT_COUNTERS:
            value = stats.get(key, 0)
            yield self._counter(name, doc, float(value) if isinstance(value, (int, float)) else 0.0)
        rejections = CounterMetricFamily(
            PREFIX + "request_rejected", "Requests refused at admission, by kind.", labels=["model_name", "reason"]
        )
        raw = stats.get("rejections", {})
        for kind, count in sorted(raw.items()) if isinstance(raw, dict) else ():
            rejections.add_metric([self._model_name, str(kind)], float(count))
        yield rejections

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], float(value))
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], float(value))
        return family
