"""Run summaries: the seed example, units, goodput, serialisability and the statistics."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, StreamingSummary, describe, summarize

MakeTimeline = Callable[..., Timeline]

STEMS = ("queue", "requeue", "ttft", "tpot", "itl", "itl_per_token", "e2el")
PREFIXES = ("mean", "median", "std", "min", "max", "p90", "p95", "p99")
BASE_KEYS = [
    "time_unit",
    "duration",
    "makespan",
    "num_requests",
    "completed",
    "finish_reasons",
    "num_rejected",
    "num_not_run",
    "num_preemptions",
    "num_preempted_requests",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "padding_waste",
    "unsent_waste",
]
SLO_KEYS = ["slo", "num_good_requests", "goodput", "request_goodput", "goodput_tokens", "slo_attainment"]


def _assert_plain_json(value: object) -> None:
    """Only plain Python types, recursively: no numpy scalars, no NaN."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str
            _assert_plain_json(item)
    else:
        assert value is None or type(value) in (int, float, str), (value, type(value))
    json.dumps(value, allow_nan=False)


# -- the seed example ---------------------------------------------------------------------------
def test_seed_continuous(continuous: list[Timeline]) -> None:
    s = summarize(continuous, time_unit="tick")
    assert s["makespan"] == 8
    assert s["duration"] == 8
    assert s["output_throughput"] == 1.375
    assert s["total_output_tokens"] == 11
    assert s["completed"] == 3
    assert s["request_throughput"] == 3 / 8
    assert s["padding_waste"] == 0
    assert s["mean_ttft_ticks"] == s["max_ttft_ticks"] == 2
    assert s["mean_tpot_ticks"] == s["p99_tpot_ticks"] == 1
    assert s["mean_queue_ticks"] == 0


def test_seed_static(static: list[Timeline]) -> None:
    s = summarize(static, time_unit="tick", padding_tokens=5)
    assert s["makespan"] == 11
    assert s["output_throughput"] == 1.0
    assert s["padding_waste"] == 5
    assert s["max_ttft_ticks"] == 5
    assert s["max_queue_ticks"] == 3
    assert s["mean_tpot_ticks"] == 1


def test_exact_key_list(continuous: list[Timeline]) -> None:
    latency = [f"{p}_{stem}_ticks" for stem in STEMS for p in PREFIXES]
    assert list(summarize(continuous, time_unit="tick")) == BASE_KEYS + latency
    assert list(summarize(continuous, time_unit="tick", slo=SLO(ttft=3))) == BASE_KEYS + latency + SLO_KEYS


def test_seconds_use_ms_keys_scaled(make_tl: MakeTimeline) -> None:
    tls = [make_tl("a", 0.0, scheduled=[0.25], tokens=[0.5, 0.75], finished=1.0)]
    s = summarize(tls, time_unit="s")
    assert not any(key.endswith("_ticks") for key in s)
    assert s["mean_ttft_ms"] == 500.0
    assert s["mean_queue_ms"] == 250.0
    assert s["mean_tpot_ms"] == 250.0
    assert s["mean_e2el_ms"] == 1000.0
    assert s["makespan"] == 1.0  # the run unit, not ms
    assert s["output_throughput"] == 2.0  # tokens per second


def test_finish_reasons_and_ttft_exclusion(make_tl: MakeTimeline) -> None:
    tls = [
        make_tl("ok", 0.0, scheduled=[0.0], tokens=[1.0, 2.0], finished=2.0, num_prompt_tokens=10),
        make_tl("rej", 0.0, finished=0.0, reason=FinishReason.REJECTED, num_prompt_tokens=100),
        make_tl("err", 1.0, scheduled=[1.0], finished=3.0, reason=FinishReason.ERROR, num_prompt_tokens=7),
    ]
    s = summarize(tls, time_unit="tick")
    assert s["finish_reasons"] == {
        "length": 1,
        "stop": 0,
        "cancelled": 0,
        "timeout": 0,
        "rejected": 1,
        "error": 1,
    }
    assert s["num_requests"] == 3
    assert s["completed"] == 1
    assert s["min_ttft_ticks"] == s["max_ttft_ticks"] == 1.0  # only "ok" emitted a token
    assert s["max_e2el_ticks"] == 2.0
    assert s["min_e2el_ticks"] == 2.0  # E2E covers the requests that ran: not the rejection's 0
    assert (s["num_rejected"], s["num_not_run"]) == (1, 1)
    assert s["total_input_tokens"] == 17  # the rejected prompt was never processed
    assert s["max_queue_ticks"] == 0.0


def _with_rejections(make_tl: MakeTimeline) -> list[Timeline]:
    """Two requests that ran (E2E 4 and 6) and three that did not: two rejected at once (E2E 0)
    and one cancelled while it waited (never scheduled, E2E 9)."""
    return [
        make_tl("a", 0.0, scheduled=[1.0], tokens=[2.0, 3.0], finished=4.0),
        make_tl("b", 0.0, scheduled=[2.0], tokens=[3.0, 4.0, 5.0, 6.0], finished=6.0),
        make_tl("r1", 1.0, finished=1.0, reason=FinishReason.REJECTED, num_prompt_tokens=50),
        make_tl("r2", 2.0, finished=2.0, reason=FinishReason.REJECTED, num_prompt_tokens=50),
        make_tl("c", 0.0, finished=9.0, reason=FinishReason.CANCELLED),
    ]


def test_latencies_cover_only_the_requests_that_ran(make_tl: MakeTimeline) -> None:
    """Issue 14: rejected requests entered mean and p99 E2E with E2E = 0, while TTFT left them out."""
    s = summarize(_with_rejections(make_tl), time_unit="tick", slo=SLO(e2e=100))
    assert s["num_requests"] == 5
    assert s["num_rejected"] == s["finish_reasons"]["rejected"] == 2  # type: ignore[index]  # reported apart
    assert s["num_not_run"] == 3  # the two rejections and the cancellation in the queue
    for stem in ("queue", "ttft", "tpot", "itl", "e2el"):  # the same two requests in every latency
        assert s[f"min_{stem}_ticks"] is not None
    assert s["mean_e2el_ticks"] == 5.0 and s["min_e2el_ticks"] == 4.0 and s["max_e2el_ticks"] == 6.0
    assert s["p99_e2el_ticks"] == pytest.approx(4.0 + 0.99 * 2.0)
    assert s["mean_ttft_ticks"] == 2.5 and s["mean_queue_ticks"] == 1.5
    assert s["total_input_tokens"] == 2  # the rejected prompts were never processed
    assert s["num_good_requests"] == 2 and s["slo_attainment"] == pytest.approx(2 / 5)  # misses


def test_a_client_side_rejection_is_left_out_though_it_was_sent(make_tl: MakeTimeline) -> None:
    """A client timeline records the send as SCHEDULED: an HTTP 429 still did not run."""
    tls = [
        make_tl("ok", 0.0, scheduled=[0.0], tokens=[1.0], finished=1.0),
        make_tl("429", 0.0, scheduled=[0.5], finished=3.0, reason=FinishReason.REJECTED, num_prompt_tokens=9),
    ]
    s = summarize(tls, time_unit="s")
    assert s["max_e2el_ms"] == s["mean_e2el_ms"] == 1000.0 and s["max_queue_ms"] == 0.0
    assert (s["num_rejected"], s["num_not_run"], s["total_input_tokens"]) == (1, 1, 1)


def test_streaming_summary_applies_the_same_rule(make_tl: MakeTimeline) -> None:
    tls = _with_rejections(make_tl)
    folded = StreamingSummary()
    for tl in reversed(tls):  # finishing order differs from arrival order
        folded.add(tl)
    assert folded.summary(time_unit="tick", slo=SLO(ttft=3)) == summarize(tls, time_unit="tick", slo=SLO(ttft=3))
    assert folded.summary(time_unit="tick")["mean_e2el_ticks"] == 5.0


@given(
    counts=st.lists(st.lists(st.sampled_from([1, 1, 1, 3]), min_size=1, max_size=6), min_size=1, max_size=6),
    gaps=st.lists(st.floats(0.001, 10.0), min_size=36, max_size=36),
)
def test_streaming_summary_pools_gaps_as_summarize_does(
    make_tl: MakeTimeline, counts: list[list[int]], gaps: list[float]
) -> None:
    """Single-token emissions first, then (perhaps) a speculative one: the streaming summary's
    pooled per-emission and per-token gaps (one array while they are equal) give `summarize`'s
    numbers, in any finishing order."""
    tls = []
    for i, per_request in enumerate(counts):
        stamps = np.cumsum(gaps[6 * i : 6 * i + len(per_request)]).tolist()
        tls.append(make_tl(f"r{i}", 0.0, tokens=stamps, counts=per_request, finished=stamps[-1]))
    folded = StreamingSummary()
    for tl in tls:
        folded.add(tl)
    assert folded.summary(time_unit="s") == summarize(tls, time_unit="s")


def test_requeue_stats_over_preempted_requests(make_tl: MakeTimeline) -> None:
    tls = [
        make_tl("p", 0.0, scheduled=[0.0, 4.0], preempted=[1.0], tokens=[5.0], finished=5.0),
        make_tl("q", 0.0, scheduled=[0.0], tokens=[1.0], finished=1.0),
    ]
    s = summarize(tls, time_unit="tick")
    assert s["num_preemptions"] == 1
    assert s["num_preempted_requests"] == 1
    assert s["mean_requeue_ticks"] == 3.0
    assert s["mean_queue_ticks"] == 0.0


def test_itl_per_token_weighting_in_summary(make_tl: MakeTimeline) -> None:
    tl = make_tl("s", 0.0, tokens=[1.0, 2.0, 2.3], counts=[1, 1, 3], finished=2.3)
    s = summarize([tl], time_unit="s")
    assert s["mean_itl_ms"] == pytest.approx((1000 + 300) / 2)
    assert s["mean_itl_per_token_ms"] == pytest.approx((1000 + 100 * 3) / 4)
    assert s["min_itl_per_token_ms"] == pytest.approx(100)


# -- goodput ------------------------------------------------------------------------------------
def test_goodput_all_meet(continuous: list[Timeline]) -> None:
    s = summarize(continuous, time_unit="tick", slo=SLO(ttft=2, tpot=1, e2e=6))  # bounds inclusive
    assert s["slo_attainment"] == 1.0
    assert s["goodput"] == s["request_goodput"] == 3 / 8
    assert s["goodput_tokens"] == 11 / 8
    assert s["slo"] == {"ttft": 2, "tpot": 1, "e2e": 6}


def test_goodput_static_c_misses_ttft(static: list[Timeline]) -> None:
    s = summarize(static, time_unit="tick", slo=SLO(ttft=3))
    assert s["num_good_requests"] == 2
    assert s["slo_attainment"] == pytest.approx(2 / 3)
    assert s["goodput"] == 2 / 11
    assert s["goodput_tokens"] == 7 / 11


def test_goodput_counts_failures_as_misses(make_tl: MakeTimeline) -> None:
    tls = [
        make_tl("ok", 0.0, tokens=[1.0, 2.0], finished=2.0),
        make_tl("cancel", 0.0, tokens=[1.0], finished=1.5, reason=FinishReason.CANCELLED),
        make_tl("timeout", 0.0, tokens=[1.0], finished=1.0, reason=FinishReason.TIMEOUT),
        make_tl("rej", 0.0, finished=0.0, reason=FinishReason.REJECTED),
        make_tl("err", 0.0, tokens=[0.5], finished=0.5, reason=FinishReason.ERROR),
        make_tl("stop", 0.0, tokens=[1.0], finished=1.0, reason=FinishReason.STOP),
    ]
    s = summarize(tls, time_unit="tick", slo=SLO(ttft=10, tpot=10, e2e=10))
    assert s["num_good_requests"] == 2
    assert s["slo_attainment"] == pytest.approx(2 / 6)
    assert s["goodput"] == 2 / 2.0
    assert s["goodput_tokens"] == 3 / 2.0
    # Throughput still counts every emitted token, goodput only the good ones.
    assert s["total_output_tokens"] == 6


def test_single_token_meets_any_tpot_slo(make_tl: MakeTimeline) -> None:
    tls = [make_tl("one", 0.0, tokens=[1.0], finished=1.0)]
    assert summarize(tls, time_unit="s", slo=SLO(tpot=0.0))["slo_attainment"] == 1.0


def test_ttft_slo_needs_a_token(make_tl: MakeTimeline) -> None:
    tls = [make_tl("none", 0.0, finished=1.0, reason=FinishReason.STOP)]
    assert summarize(tls, time_unit="s", slo=SLO(ttft=5.0))["slo_attainment"] == 0.0
    assert summarize(tls, time_unit="s", slo=SLO(e2e=5.0))["slo_attainment"] == 1.0


def test_slo_rejects_negative_and_nan() -> None:
    with pytest.raises(ValueError, match="ttft"):
        SLO(ttft=-1.0)
    with pytest.raises(ValueError, match="e2e"):
        SLO(e2e=float("nan"))


# -- serialisability and errors -----------------------------------------------------------------
def test_json_serialisable(continuous: list[Timeline]) -> None:
    s = summarize(continuous, time_unit="s", padding_tokens=3, unsent_tokens=2, slo=SLO(ttft=1.0))
    _assert_plain_json(s)


def test_json_serialisable_when_everything_is_empty(make_tl: MakeTimeline) -> None:
    tls = [make_tl("rej", 1.0, finished=1.0, reason=FinishReason.REJECTED)]
    s = summarize(tls, time_unit="tick", slo=SLO(ttft=1.0))
    _assert_plain_json(s)
    assert s["makespan"] == 0.0
    assert s["output_throughput"] is None  # zero makespan: no rate, not NaN or inf
    assert s["goodput"] is None
    assert s["mean_ttft_ticks"] is None
    assert s["p99_tpot_ticks"] is None
    assert s["mean_e2el_ticks"] is None  # no request ran: no latency at all
    assert (s["num_rejected"], s["num_not_run"]) == (1, 1)


def test_empty_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        summarize([], time_unit="s")


def test_unfinished_is_an_error(make_tl: MakeTimeline, continuous: list[Timeline]) -> None:
    with pytest.raises(ValueError, match="'D'"):
        summarize([*continuous, make_tl("D", 0.0, tokens=[1.0])], time_unit="tick")


def test_bad_arguments(continuous: list[Timeline]) -> None:
    with pytest.raises(ValueError, match="time_unit"):
        summarize(continuous, time_unit="ms")
    with pytest.raises(ValueError, match="waste"):
        summarize(continuous, time_unit="tick", padding_tokens=-1)
    with pytest.raises(ValueError, match="'A'"):
        summarize([*continuous, continuous[0]], time_unit="tick")


def test_accepts_a_generator(continuous: list[Timeline]) -> None:
    assert summarize((tl for tl in continuous), time_unit="tick")["num_requests"] == 3


# -- statistics against numpy -------------------------------------------------------------------
_values = st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=60)


@given(_values)
def test_describe_matches_numpy(values: list[float]) -> None:
    stats = describe(values)
    arr = np.asarray(values)
    assert stats["mean"] == pytest.approx(float(np.mean(arr)))
    assert stats["median"] == pytest.approx(float(np.median(arr)))
    assert stats["std"] == pytest.approx(float(np.std(arr)), abs=1e-9)
    assert stats["min"] == min(values)
    assert stats["max"] == max(values)
    for p in (90, 95, 99):
        assert stats[f"p{p}"] == pytest.approx(float(np.percentile(arr, p)))
    assert all(type(v) is float for v in stats.values())


@given(
    st.lists(
        st.one_of(st.floats(allow_nan=False), st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e308])),
        min_size=1,
        max_size=300,
    )
)
def test_the_median_and_percentiles_of_a_sorted_sample_are_numpys_to_the_last_bit(values: list[float]) -> None:
    from contbatch.metrics.stats import PERCENTILES, _sorted_median, _sorted_percentiles

    arr = np.sort(np.asarray(values, dtype=np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        expected = [np.median(np.asarray(values)), *np.percentile(np.asarray(values), PERCENTILES)]
        got = [_sorted_median(arr), *_sorted_percentiles(arr)]
    assert [type(g) for g in got] == [np.float64] * len(expected)
    for g, e in zip(got, expected, strict=True):
        assert (math.isnan(g) and math.isnan(e)) or g == e  # (0.0 == -0.0: order decides)


@given(ttfts=_values)
def test_summary_ttft_percentiles_match_numpy(make_tl: MakeTimeline, ttfts: list[float]) -> None:
    tls = [make_tl(f"r{i}", 0.0, tokens=[t], finished=t) for i, t in enumerate(ttfts)]
    s = summarize(tls, time_unit="s")
    arr = np.asarray(ttfts) * 1000
    assert s["median_ttft_ms"] == pytest.approx(float(np.median(arr)))
    for p in (90, 95, 99):
        assert s[f"p{p}_ttft_ms"] == pytest.approx(float(np.percentile(arr, p)))
    _assert_plain_json(s)


@given(
    gaps=st.lists(st.floats(0.001, 10.0), min_size=2, max_size=15),
    counts=st.lists(st.integers(1, 4), min_size=15, max_size=15),
)
def test_summary_itl_per_token_matches_repeat(make_tl: MakeTimeline, gaps: list[float], counts: list[int]) -> None:
    ts = np.cumsum(gaps).tolist()
    used = counts[: len(ts)]
    tl = make_tl("h", 0.0, tokens=ts, counts=used, finished=ts[-1])
    s = summarize([tl], time_unit="tick")
    diffs = np.diff(ts)
    expected = np.repeat(diffs / np.asarray(used[1:]), used[1:])
    assert s["mean_itl_per_token_ticks"] == pytest.approx(float(np.mean(expected)))
    assert s["p99_itl_per_token_ticks"] == pytest.approx(float(np.percentile(expected, 99)))
    assert s["p90_itl_ticks"] == pytest.approx(float(np.percentile(diffs, 90)))


def test_subnormal_makespan_gives_none_not_inf(make_tl: MakeTimeline) -> None:
    s = summarize([make_tl("tiny", 0.0, tokens=[5e-324], finished=5e-324)], time_unit="s")
    assert s["output_throughput"] is None
    _assert_plain_json(s)


def test_non_finite_timestamp_is_an_error() -> None:
    tl = Timeline("inf", 0.0, 1)
    tl.record_finished(float("inf"), FinishReason.STOP)
    with pytest.raises(ValueError, match=r"'inf'.*finite"):
        summarize([tl], time_unit="s")


_emissions = st.lists(st.tuples(st.floats(0.0, 5.0, allow_nan=False), st.integers(1, 4)), max_size=6)


@given(st.lists(_emissions, min_size=1, max_size=6))
def test_pooled_itls_equal_each_requests_gaps_concatenated(requests: list[list[tuple[float, int]]]) -> None:
    """The summary pools every inter-token gap at once (`pooled_itls`, vectorised); it equals
    each request's own gaps (`itls`) concatenated, per emission and per token, across request
    boundaries and requests with zero or one emission."""
    from contbatch.metrics.request import itls
    from contbatch.metrics.summary import pooled_itls

    timelines = []
    for i, emissions in enumerate(requests):
        tl = Timeline(f"r{i}", 0.0, 4)
        tl.record_scheduled(0.0)
        ts = 0.0
        for gap, n in emissions:
            ts += gap
            tl.record_tokens(ts, n)
        tl.record_finished(ts + 1.0, FinishReason.LENGTH)
        timelines.append(tl)
    per_emission, per_token = pooled_itls(timelines)
    assert list(per_emission) == [g for tl in timelines for g in itls(tl)[0]]
    assert list(per_token) == [g for tl in timelines for g in itls(tl)[1]]
