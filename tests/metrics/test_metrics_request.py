"""Per-request definitions: queue, requeue, TTFT, TPOT, ITL, E2E."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics import REQUEST_COLUMNS, per_request_table, request_metrics

MakeTimeline = Callable[..., Timeline]


def test_seed_continuous_per_request(continuous: list[Timeline]) -> None:
    table = per_request_table(continuous)
    assert [m.request_id for m in table] == ["A", "B", "C"]
    assert {m.request_id: m.ttft for m in table} == {"A": 2, "B": 2, "C": 2}
    assert {m.request_id: m.tpot for m in table} == {"A": 1, "B": 1, "C": 1}
    assert {m.request_id: m.completion_ts for m in table} == {"A": 6, "B": 3, "C": 8}
    assert {m.request_id: m.queue_time for m in table} == {"A": 0, "B": 0, "C": 0}
    assert {m.request_id: m.e2e for m in table} == {"A": 6, "B": 3, "C": 5}
    assert sum(m.num_output_tokens for m in table) == 11


def test_seed_static_per_request(static: list[Timeline]) -> None:
    by_id = {m.request_id: m for m in per_request_table(static)}
    assert {r: m.completion_ts for r, m in by_id.items()} == {"A": 6, "B": 3, "C": 11}
    assert by_id["C"].ttft == 5
    assert by_id["C"].queue_time == 3
    assert by_id["C"].tpot == 1
    assert by_id["C"].first_scheduled_ts == 6
    assert by_id["C"].first_token_ts == 8


def test_table_sorted_by_arrival_then_id(make_tl: MakeTimeline) -> None:
    tls = [
        make_tl("z", 1.0, tokens=[2.0], finished=2.0),
        make_tl("b", 0.0, tokens=[2.0], finished=2.0),
        make_tl("a", 1.0, tokens=[2.0], finished=2.0),
    ]
    assert [m.request_id for m in per_request_table(tls)] == ["b", "a", "z"]


def test_speculative_emission_itl_per_token(make_tl: MakeTimeline) -> None:
    tl = make_tl("s", 0.0, scheduled=[0.0], tokens=[1.0, 1.25, 1.55], counts=[1, 1, 3], finished=1.55)
    m = request_metrics(tl)
    assert m.num_output_tokens == 5
    assert m.num_emissions == 3
    assert m.itl_per_emission == pytest.approx([0.25, 0.3])
    # The 0.3 gap carried 3 tokens: three samples of 0.1, not one of 0.3.
    assert m.itl_per_token == pytest.approx([0.25, 0.1, 0.1, 0.1])
    assert m.tpot == pytest.approx(0.55 / 4)


def test_first_emission_tokens_have_no_itl(make_tl: MakeTimeline) -> None:
    m = request_metrics(make_tl("s", 0.0, tokens=[1.0, 2.0], counts=[3, 2], finished=2.0))
    assert m.itl_per_emission == (1.0,)
    assert m.itl_per_token == (0.5, 0.5)
    assert m.tpot == pytest.approx(1.0 / 4)


def test_single_multi_token_emission_has_zero_tpot(make_tl: MakeTimeline) -> None:
    m = request_metrics(make_tl("s", 0.0, tokens=[1.0], counts=[3], finished=1.0))
    assert m.tpot == 0
    assert m.itl_per_emission == ()


def test_single_token_tpot_is_none(make_tl: MakeTimeline) -> None:
    m = request_metrics(make_tl("one", 0.0, scheduled=[0.5], tokens=[1.0], finished=1.0))
    assert m.tpot is None
    assert m.ttft == 1.0
    assert m.itl_per_emission == ()
    assert m.itl_per_token == ()


def test_no_tokens_no_schedule(make_tl: MakeTimeline) -> None:
    m = request_metrics(make_tl("r", 2.0, finished=2.0, reason=FinishReason.REJECTED))
    assert m.ttft is None
    assert m.tpot is None
    assert m.queue_time is None
    assert m.first_token_ts is None
    assert m.e2e == 0
    assert not m.succeeded


def test_preemption_requeue_reported_separately(make_tl: MakeTimeline) -> None:
    tl = make_tl(
        "p",
        0.0,
        scheduled=[1.0, 5.0, 10.0],
        preempted=[3.0, 6.0],
        tokens=[2.0, 3.0, 11.0, 12.0],
        finished=12.0,
    )
    m = request_metrics(tl)
    assert m.queue_time == 1.0
    assert m.requeue_time == (5.0 - 3.0) + (10.0 - 6.0)
    assert m.num_preemptions == 2


def test_preempted_then_cancelled_while_waiting(make_tl: MakeTimeline) -> None:
    tl = make_tl("p", 0.0, scheduled=[1.0], preempted=[3.0], tokens=[2.0], finished=7.0, reason=FinishReason.CANCELLED)
    assert request_metrics(tl).requeue_time == 4.0


def test_preempt_and_readmit_at_same_instant(make_tl: MakeTimeline) -> None:
    tl = make_tl("p", 0.0, scheduled=[1.0, 3.0], preempted=[3.0], tokens=[4.0], finished=4.0)
    m = request_metrics(tl)
    assert m.requeue_time == 0.0
    assert m.queue_time == 1.0


def test_never_scheduled_requeue_is_zero(make_tl: MakeTimeline) -> None:
    assert request_metrics(make_tl("n", 0.0, tokens=[1.0], finished=1.0)).requeue_time == 0.0


def test_unfinished_request_is_an_error(make_tl: MakeTimeline) -> None:
    with pytest.raises(ValueError, match=r"'late'.*never finished"):
        request_metrics(make_tl("late", 0.0, scheduled=[0.0], tokens=[1.0]))


def test_unpaired_preemption_is_an_error() -> None:
    tl = Timeline("bad", 0.0, 1, preempted_ts=[1.0], finished_ts=2.0, finish_reason=FinishReason.ERROR)
    with pytest.raises(ValueError, match="'bad'"):
        request_metrics(tl)


def test_unparallel_token_lists_are_an_error() -> None:
    tl = Timeline("bad", 0.0, 1, token_ts=[1.0, 2.0], token_counts=[1], finished_ts=2.0)
    tl.finish_reason = FinishReason.STOP
    with pytest.raises(ValueError, match=r"'bad'.*token_ts"):
        request_metrics(tl)


def test_row_columns_match_export_columns(continuous: list[Timeline]) -> None:
    row = request_metrics(continuous[0]).as_row()
    assert tuple(row) == REQUEST_COLUMNS
    assert row["finish_reason"] == "length"
    assert row["finished_ts"] == 6


@given(
    gaps=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=20),
    counts=st.lists(st.integers(1, 5), min_size=20, max_size=20),
    ttft=st.floats(0.0, 10.0),
)
def test_itl_invariants(make_tl: MakeTimeline, gaps: list[float], counts: list[int], ttft: float) -> None:
    ts = [ttft]
    for gap in gaps[1:]:
        ts.append(ts[-1] + gap)
    tl = make_tl("h", 0.0, tokens=ts, counts=counts[: len(ts)], finished=ts[-1])
    m = request_metrics(tl)
    assert len(m.itl_per_emission) == len(ts) - 1
    assert len(m.itl_per_token) == m.num_output_tokens - counts[0]
    # Per-token samples redistribute each gap over its tokens: the totals agree.
    assert sum(m.itl_per_token) == pytest.approx(sum(m.itl_per_emission))
    assert sum(m.itl_per_emission) == pytest.approx(ts[-1] - ts[0])
    if m.num_output_tokens >= 2:
        assert m.tpot is not None
        assert m.tpot * (m.num_output_tokens - 1) == pytest.approx(ts[-1] - ts[0])
