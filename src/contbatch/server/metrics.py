"""Prometheus metrics of the server, named like vLLM's (``contbatch:`` instead of ``vllm:``).

Two sources, no callbacks sprinkled through the code:

- the driver's snapshot (`DriverSnapshot`, replaced after every step), read at scrape time by a
  collector: the gauges (running, waiting, paused requests, KV usage) and the counters the loop
  and the scheduler keep (generated tokens, steps, failed steps, padding waste, preemptions,
  prefix cache queries and hits, generated-but-unsent tokens, rejections);
- the step loop's observer calls (a `contbatch.loop.StepObserver`), on the driver thread:
  `on_step` times the step, and `on_finished` counts the finished request by its finish reason
  and observes the latency histograms from its timeline with the definitions of
  `contbatch.metrics.request` (one definition of TTFT, TPOT, ITL, E2E, queue time); its prompt
  tokens and latencies count only when its prompt was processed (it was scheduled or emitted a
  token, as `contbatch.metrics.summarize` counts input tokens): a request that never ran has no
  latency to observe.

Finished requests, one family per outcome, so that no family mixes successes and failures:

- ``request_success_total{finished_reason}``: ``stop`` or ``length`` only (vLLM's names; vLLM's
  ``abort`` has its own families here);
- ``request_cancelled_total``: cancelled by the client (a disconnect) or by the server's shutdown;
- ``request_timeout_total``: a TTFT or total-time limit passed;
- ``request_rejected_total{reason}``: refused at admission (the scheduler's kind: ``queue_full``,
  ``max_model_len``, ``kv_capacity``, ``token_budget``, ``tenant_quota``; the driver's:
  ``duplicate_id``, ``invalid``, ``internal``); requests refused by the HTTP layer (a 400, 404
  or 413 before the driver saw them) are not counted;
- ``request_failed_total{stage}``: ended with an error: ``step`` (the executor, i.e. the
  forward pass or sampling, or applying its result), ``output`` (detokenization or the stop
  check), ``delivery`` (its event could not be handed to its client: a sink that raised, a
  response that could not be written), ``internal`` (the driver), ``other``.

Their sum is the number of requests the driver finished. Besides, at the HTTP level,
``http_request_errors_total{status}`` counts every response sent with an error status (4xx,
5xx: the refusals of validation, tokenization, access and admission before the driver sees a
request, and the errors of requests it finished); a stream's error event after its 200 is not
one (its request is counted above). Every family is exported from the
start, each known label value at 0. Every metric has a ``model_name`` label. The registry is per
server (no global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contbatch.core.request import Request
from contbatch.core.status import FinishReason
from contbatch.loop.core import RequestOutput
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

SUCCESS_REASONS = ("stop", "length")
REJECT_KINDS = (  # shown at 0 from the start; any other kind appears when it happens
    "queue_full",
    "max_model_len",
    "kv_capacity",
    "token_budget",
    "tenant_quota",
    "duplicate_id",
    "invalid",
    "internal",
)
FAILURE_STAGES = ("step", "output", "delivery", "internal", "other")
# how the loop and the driver word an ERROR's detail, by stage (the first match wins)
_STAGE_PREFIXES = (
    ("the executor failed", "step"),
    ("its output could not be processed", "output"),
    ("its output could not be delivered", "delivery"),
    ("internal error", "internal"),
)
# the error statuses exported from the start (any other is counted when it happens)
HTTP_ERROR_STATUSES = (400, 401, 404, 405, 408, 413, 415, 429, 499, 500, 503, 504)

# snapshot counters: (metric name without _total, help, SchedulerStats key)
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
    (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (first admissions, with prefix caching on).",
        "num_prefix_query_tokens",
    ),
    (
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache (prefill saved).",
        "num_prefix_hit_tokens",
    ),
)


def failure_stage(detail: str) -> str:
    """The stage a request with finish reason ERROR failed at, from its detail: one of `FAILURE_STAGES`."""
    for prefix, stage in _STAGE_PREFIXES:
        if detail.startswith(prefix):
            return stage
    return "other"


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
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests that finished normally, by finish reason (stop, length).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.request_cancelled = Counter(
            PREFIX + "request_cancelled",
            "Requests cancelled by their client (a disconnect) or by the server's shutdown.",
            labels,
            registry=reg,
        )
        self.request_timeout = Counter(
            PREFIX + "request_timeout", "Requests ended by a TTFT or total-time limit.", labels, registry=reg
        )
        self.request_failed = Counter(
            PREFIX + "request_failed",
            "Requests ended by an error, by stage (step: the executor; output: detokenization or the stop check; "
            "internal: the driver; other).",
            ["model_name", "stage"],
            registry=reg,
        )
        self.http_errors = Counter(
            PREFIX + "http_request_errors",
            "HTTP responses sent with an error status (4xx, 5xx), by status code.",
            ["model_name", "status"],
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
        # every series shows from the start, at 0 until it happens
        for metric in (
            self.prompt_tokens,
            self.request_cancelled,
            self.request_timeout,
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.step_time,
        ):
            metric.labels(model_name)
        for reason in SUCCESS_REASONS:
            self.request_success.labels(model_name, reason)
        for stage in FAILURE_STAGES:
            self.request_failed.labels(model_name, stage)
        for status in HTTP_ERROR_STATUSES:
            self.http_errors.labels(model_name, str(status))

    def count_http_error(self, status: int) -> None:
        """An HTTP response with an error status was sent (any thread)."""
        self.http_errors.labels(self.model_name, str(status)).inc()

    # -- StepObserver (the driver thread) -------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        self.step_time.labels(self.model_name).observe(record.end_ts - record.start_ts)

    def on_finished(self, request: Request, final: RequestOutput) -> None:
        m = request_metrics(request.timeline)
        self._count_finish(final.finish_reason or m.finish_reason, final.finish_detail)  # what the client saw
        if m.first_scheduled_ts is None and m.num_output_tokens == 0:
            return  # never ran (rejected, or cancelled / timed out while waiting): no latency to observe
        name = self.model_name
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

    def _count_finish(self, reason: FinishReason, detail: str) -> None:
        name = self.model_name
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.request_success.labels(name, reason.value).inc()
        elif reason is FinishReason.CANCELLED:
            self.request_cancelled.labels(name).inc()
        elif reason is FinishReason.TIMEOUT:
            self.request_timeout.labels(name).inc()
        elif reason is FinishReason.ERROR:
            self.request_failed.labels(name, failure_stage(detail)).inc()
        # REJECTED: counted by kind from the scheduler's and the driver's counters (request_rejected_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """Gauges and the loop's and scheduler's counters, read from the driver's latest snapshot at
    scrape time."""

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
            "generation_tokens", "Output tokens generated (appended to requests).", snap.num_generated_tokens
        )
        yield self._counter(
            "padding_tokens", "Token-work computed for no request (padding waste).", snap.num_padding_tokens
        )
        yield self._counter("num_steps", "Steps run.", snap.num_steps)
        yield self._counter(
            "num_failed_steps", "Steps whose executor raised (their requests end with an error).", snap.num_failed_steps
        )
        for name, doc, key in _STAT_COUNTERS:
            value = stats.get(key, 0)
            yield self._counter(name, doc, float(value) if isinstance(value, (int, float)) else 0.0)
        yield self._rejections(stats.get("rejections"), snap.rejections)

    def _rejections(self, scheduler: object, driver: dict[str, int]) -> CounterMetricFamily:
        counts = dict.fromkeys(REJECT_KINDS, 0)
        for source in (scheduler if isinstance(scheduler, dict) else {}, driver):
            for kind, count in source.items():
                counts[str(kind)] = counts.get(str(kind), 0) + int(count)
        family = CounterMetricFamily(
            PREFIX + "request_rejected",
            "Requests refused at admission, by kind (the scheduler's or the driver's).",
            labels=["model_name", "reason"],
        )
        for kind, count in counts.items():
            family.add_metric([self._model_name, kind], float(count))
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], float(value))
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], float(value))
        return family
