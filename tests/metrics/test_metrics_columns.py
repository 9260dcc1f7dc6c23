"""The vectorised summary equals the pure-Python definitions: `RequestColumns` equals
`request_metrics` field by field, the exact sum equals `math.fsum`, and `summarize` equals a
summary built from per-request rows the pure-Python way (`math.fsum` sums, each statistic of
the unsorted sample), for random timelines (preemptions, multi-token emissions, every finish
reason, deadlines) and with the same errors for broken ones."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, request_metrics, summarize, summarize_rows
from contbatch.metrics import stats as stats_module
from contbatch.metrics.columns import columns_of_rows, timeline_columns
from contbatch.metrics.request import itls
from contbatch.metrics.stats import STAT_PREFIXES, _exact_sum, latency_scale, latency_suffix

# -- the exact sum ------------------------------------------------------------------------------
_any_float = st.floats(allow_nan=False, allow_infinity=False)
_small = st.one_of(
    st.floats(-1e6, 1e6),
    st.floats(-1e-300, 1e-300),
    st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1.0, 0.1, 1e16, -1e16, 2.0**-1074, 2.0**1000]),
)


def _fsum_or_error(values: list[float]) -> float | str:
    try:
        return math.fsum(values)
    except (OverflowError, ValueError) as exc:
        return type(exc).__name__


def _exact_or_error(values: list[float]) -> float | str:
    try:
        return _exact_sum(np.asarray(values, dtype=np.float64))
    except (OverflowError, ValueError) as exc:
        return type(exc).__name__


def _same(a: float | str, b: float | str) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


@given(st.lists(st.one_of(_small, _any_float), max_size=80))
def test_exact_sum_is_fsum(values: list[float]) -> None:
    assert _same(_exact_or_error(values), _fsum_or_error(values))


@given(st.lists(_small, min_size=1, max_size=8), st.integers(1, 5000))
def test_exact_sum_is_fsum_on_repeats(values: list[float], n: int) -> None:
    """Many values of few exponents (bin sums far above one value), and n equal values."""
    repeated = (values * (n // len(values) + 1))[:n]
    assert _same(_exact_or_error(repeated), _fsum_or_error(repeated))
    assert _same(_exact_or_error([values[0]] * n), _fsum_or_error([values[0]] * n))


@given(
    st.lists(_small, min_size=1, max_size=8),
    st.lists(st.integers(1, 60), min_size=8, max_size=8),
    st.floats(-1e3, 1e3),
)
def test_exact_sum_is_fsum_on_runs(values: list[float], lengths: list[int], about: float) -> None:
    """Runs of equal neighbours (a sorted sample of few distinct values: inter-token gaps), which
    are summed run by run, as they come and sorted; the squared deviations from `about` too."""
    runs = [value for value, length in zip(values, lengths, strict=False) for _ in range(length)]
    for sample in (runs, sorted(runs)):
        assert _same(_exact_or_error(sample), _fsum_or_error(sample))
        deviations = [(x - about) * (x - about) for x in sample]
        with np.errstate(over="ignore"):  # (a huge value's square is inf, as in Python)
            exact = _exact_sum(np.asarray(sample, dtype=np.float64), about=about)
        assert _same(exact, _fsum_or_error(deviations))


@pytest.mark.parametrize(
    "values",
    [[float("inf"), 1.0], [float("-inf"), float("inf")], [float("nan"), 2.0], [1e308, 1e308], [1e308, 1e308, -1e308]],
)
def test_exact_sum_is_fsum_where_fsum_overflows_or_sees_non_finite(values: list[float]) -> None:
    assert _same(_exact_or_error(values), _fsum_or_error(values))


def test_exact_sum_of_many_values() -> None:
    rng = np.random.default_rng(5)
    values = np.concatenate([rng.exponential(20.0, 300_000), -rng.exponential(1e-3, 1000), rng.normal(0, 1e12, 10)])
    assert _exact_sum(values) == math.fsum(values.tolist())


# -- random timelines -----------------------------------------------------------------------------
@st.composite
def timelines(draw: st.DrawFn, index: int = 0) -> Timeline:
    arrival = draw(st.sampled_from([0.0, 0.5, 3, 1e6])) + draw(st.floats(0.0, 10.0))
    deadline = draw(st.one_of(st.none(), st.floats(0.0, 40.0).map(lambda d: arrival + d)))
    tl = Timeline(
        f"r{index}",
        arrival,
        draw(st.integers(0, 50)),
        tenant=draw(st.sampled_from([None, "a"])),
        deadline_ts=deadline,
    )
    reason = draw(st.sampled_from(list(FinishReason)))
    ts = arrival
    if reason is not FinishReason.REJECTED and draw(st.booleans()):
        for k in range(draw(st.integers(1, 3))):
            if k:
                ts += draw(st.floats(0.0, 2.0))
                tl.record_preempted(ts)
                if draw(st.integers(0, 4)) == 0:
                    break  # preempted, never re-admitted
            ts += draw(st.floats(0.0, 2.0))
            tl.record_scheduled(ts)
            for _ in range(draw(st.integers(0, 5))):
                ts += draw(st.sampled_from([0.0, 0.25, 1e-9])) + draw(st.floats(0.0, 1.0))
                tl.record_tokens(ts, draw(st.sampled_from([1, 1, 1, 2, 3])))
    elif reason is not FinishReason.REJECTED and draw(st.integers(0, 3)) == 0:
        ts += 0.5
        tl.record_tokens(ts, 1)  # a client-side timeline that saw a token but no scheduling
    tl.record_finished(ts + draw(st.floats(0.0, 1.0)), reason)
    return tl


@st.composite
def runs(draw: st.DrawFn) -> list[Timeline]:
    n = draw(st.integers(1, 12))
    return [draw(timelines(i)) for i in range(n)]


_COLUMN_FIELDS = (
    "num_prompt_tokens",
    "num_output_tokens",
    "num_preemptions",
    "arrival_ts",
    "completion_ts",
    "requeue_time",
    "e2e",
)


@settings(max_examples=200, deadline=None)
@given(runs())
def test_columns_equal_request_metrics(tls: list[Timeline]) -> None:
    rows = [request_metrics(tl) for tl in tls]
    cols, (per_emission, per_token) = timeline_columns(tls)
    for made in (cols, columns_of_rows(rows)):
        for name in _COLUMN_FIELDS:
            assert getattr(made, name).tolist() == [getattr(m, name) for m in rows], name
        for name, mask in (("queue_time", "has_queue_time"), ("ttft", "has_ttft"), ("tpot", "has_tpot")):
            values, present = getattr(made, name), getattr(made, mask)
            assert [v if p else None for v, p in zip(values.tolist(), present.tolist(), strict=True)] == [
                getattr(m, name) for m in rows
            ], name
        assert made.ran.tolist() == [m.ran for m in rows]
        assert made.succeeded.tolist() == [m.succeeded for m in rows]
        deadlines = zip(made.deadline_ts.tolist(), made.has_deadline.tolist(), strict=True)
        assert [deadline if has else None for deadline, has in deadlines] == [m.deadline_ts for m in rows]
    ran = [tl for tl, m in zip(tls, rows, strict=True) if m.ran]
    assert list(per_emission) == [g for tl in ran for g in itls(tl)[0]]
    assert list(per_token) == [g for tl in ran for g in itls(tl)[1]]


# -- the summary against the pure-Python way -------------------------------------------------------
def _describe_reference(values: list[float], scale: float) -> dict[str, float | None]:
    """The statistics of `stats.describe`, the pure-Python way: fsum sums over the sample in its
    own order, numpy's median and percentiles of the unsorted sample."""
    if not values:
        return dict.fromkeys(STAT_PREFIXES)
    arr = np.asarray(values, dtype=np.float64) * scale
    mean = math.fsum(arr.tolist()) / len(arr)
    spread = math.sqrt(math.fsum(((arr - mean) ** 2).tolist()) / len(arr))
    raw = [mean, float(np.median(arr)), spread, float(np.min(arr)), float(np.max(arr))]
    raw += [float(p) for p in np.percentile(arr, (90, 95, 99))]
    return dict(zip(STAT_PREFIXES, raw, strict=True))


def _reference(tls: list[Timeline], time_unit: str, slo: SLO) -> dict[str, object]:
    """The run summary computed from `request_metrics` rows, one request at a time."""
    rows = [request_metrics(tl) for tl in tls]
    ran = [m for m in rows if m.ran]
    makespan = float(max(m.completion_ts for m in rows) - min(m.arrival_ts for m in rows))

    def rate(amount: float) -> float | None:
        value = amount / makespan if makespan > 0 else None
        return value if value is None or math.isfinite(value) else None

    good = [m for m in rows if slo.is_met_by(m)]
    total_input = sum(m.num_prompt_tokens for m in ran)
    total_output = sum(m.num_output_tokens for m in rows)
    verdicts = [m.met_deadline for m in rows if m.met_deadline is not None]
    out: dict[str, object] = {
        "makespan": makespan,
        "completed": sum(m.succeeded for m in rows),
        "finish_reasons": {r.value: sum(m.finish_reason is r for m in rows) for r in FinishReason},
        "num_not_run": len(rows) - len(ran),
        "num_preemptions": sum(m.num_preemptions for m in rows),
        "num_preempted_requests": sum(m.num_preemptions > 0 for m in rows),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": rate(sum(m.succeeded for m in rows)),
        "output_throughput": rate(total_output),
        "total_token_throughput": rate(total_input + total_output),
        "num_good_requests": len(good),
        "goodput": rate(len(good)),
        "goodput_tokens": rate(sum(m.num_output_tokens for m in good)),
        "slo_attainment": len(good) / len(rows),
    }
    if verdicts:
        out["num_deadline_requests"] = len(verdicts)
        out["deadline_attainment"] = verdicts.count(True) / len(verdicts)
    samples = {
        "queue": [m.queue_time for m in ran if m.queue_time is not None],
        "requeue": [m.requeue_time for m in ran if m.num_preemptions > 0],
        "ttft": [m.ttft for m in ran if m.ttft is not None],
        "tpot": [m.tpot for m in ran if m.tpot is not None],
        "itl": [g for m in ran for g in m.itl_per_emission],
        "itl_per_token": [g for m in ran for g in m.itl_per_token],
        "e2el": [m.e2e for m in ran],
    }
    suffix, scale = latency_suffix(time_unit), latency_scale(time_unit)
    for name, values in samples.items():
        for prefix, value in _describe_reference(values, scale).items():
            out[f"{prefix}_{name}_{suffix}"] = value
    return out


@settings(max_examples=200, deadline=None)
@given(runs(), st.sampled_from(["s", "tick"]), st.floats(0.0, 3.0), st.floats(0.0, 1.0), st.floats(0.0, 20.0))
def test_summary_equals_the_pure_python_way(
    tls: list[Timeline], time_unit: str, ttft: float, tpot: float, e2e: float
) -> None:
    slo = SLO(ttft=ttft, tpot=tpot, e2e=e2e)
    summary = summarize(tls, time_unit=time_unit, slo=slo)
    expected = _reference(tls, time_unit, slo)
    for key, value in expected.items():
        assert summary[key] == value, key
    assert summarize_rows([request_metrics(tl) for tl in tls], time_unit=time_unit, slo=slo) == summary


def test_summary_statistics_do_not_depend_on_the_exact_sum_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorised exact sum and `math.fsum` give the same summary of a large run."""
    rng = np.random.default_rng(3)
    tls = []
    for i in range(300):
        tl = Timeline(f"r{i}", float(i), 10)
        tl.record_scheduled(float(i) + rng.exponential(0.1))
        for ts in np.cumsum(rng.exponential(0.02, 200)) + float(i) + 1.0:
            tl.record_tokens(float(ts))
        tl.record_finished(tl.token_ts[-1], FinishReason.LENGTH)
        tls.append(tl)
    vectorised = summarize(tls, time_unit="s")

    def fsum(arr: np.ndarray[Any, Any], *, about: float | None = None) -> float:
        return math.fsum((arr if about is None else (arr - about) ** 2).tolist())

    monkeypatch.setattr(stats_module, "_exact_sum", fsum)
    assert summarize(tls, time_unit="s") == vectorised


def _broken() -> list[Timeline]:
    unfinished = Timeline("unfinished", 0.0, 1)
    not_finite = Timeline("not-finite", 0.0, 1)
    not_finite.record_finished(float("inf"), FinishReason.STOP)
    unpaired = Timeline("unpaired", 0.0, 1)
    unpaired.record_tokens(1.0)
    unpaired.record_finished(2.0, FinishReason.LENGTH)
    unpaired.token_counts.append(1)
    no_tokens = Timeline("zero-tokens", 0.0, 1)
    no_tokens.record_tokens(1.0)
    no_tokens.token_counts[0] = 0
    no_tokens.record_finished(2.0, FinishReason.LENGTH)
    preempted = Timeline("preempted-twice", 0.0, 1)
    preempted.record_preempted(1.0)
    preempted.record_finished(2.0, FinishReason.LENGTH)
    return [unfinished, not_finite, unpaired, no_tokens, preempted]


@pytest.mark.parametrize("bad", _broken(), ids=lambda tl: tl.request_id)
def test_a_broken_timeline_raises_what_request_metrics_raises(bad: Timeline) -> None:
    good = Timeline("good", 0.0, 1)
    good.record_scheduled(0.5)
    good.record_tokens(1.0)
    good.record_finished(1.0, FinishReason.LENGTH)
    with pytest.raises(ValueError) as expected:
        request_metrics(bad)
    with pytest.raises(ValueError) as raised:
        summarize([good, bad, good], time_unit="s")
    assert str(raised.value) == str(expected.value)


def test_duplicate_ids_are_named() -> None:
    tl = Timeline("twice", 0.0, 1)
    tl.record_finished(1.0, FinishReason.LENGTH)
    with pytest.raises(ValueError, match="'twice' appears in more than one timeline"):
        summarize([tl, tl], time_unit="s")
