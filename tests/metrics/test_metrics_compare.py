"""Plain-text tables: compact numbers, unit-labelled rows, one column per run."""

from __future__ import annotations

import pytest

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, format_compare_table, format_number, format_summary, summarize


def _table(text: str) -> dict[str, list[str]]:
    """{row label: cells} of a rendered table (labels may contain spaces; cells never do)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines()[2:]:
        label, _, rest = line.partition("  ")
        rows[label.strip()] = rest.split()
    return rows


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (11, "11"),
        (11.0, "11"),
        (1.0, "1"),
        (1.375, "1.375"),
        (0.0, "0"),
        (4666.666666, "4666.667"),
        (0.0625, "0.0625"),
        (2 / 3, "0.6667"),
        (-1.5, "-1.5"),
        (1.0000000001, "1"),
        ("tick", "tick"),
    ],
)
def test_format_number(value: object, text: str) -> None:
    assert format_number(value) == text


def test_compare_seed(continuous: list[Timeline], static: list[Timeline]) -> None:
    text = format_compare_table(
        {
            "static": summarize(static, time_unit="tick", padding_tokens=5),
            "continuous": summarize(continuous, time_unit="tick"),
        }
    )
    header = text.splitlines()[0].split()
    assert header == ["metric", "static", "continuous"]
    rows = _table(text)
    assert rows["requests"] == ["3", "3"]
    assert rows["makespan (ticks)"] == ["11", "8"]
    assert rows["throughput (tok/tick)"] == ["1", "1.375"]
    assert rows["padding waste (tokens)"] == ["5", "0"]
    assert rows["p50 TTFT (ticks)"] == ["2", "2"]
    assert rows["mean TTFT (ticks)"] == ["3", "2"]
    assert rows["mean TPOT (ticks)"] == ["1", "1"]
    assert rows["finished: length"] == ["3", "3"]
    for label in ("mean queue", "p99 queue", "p99 TPOT", "mean ITL", "p99 ITL", "mean E2E", "p99 E2E"):
        assert f"{label} (ticks)" in rows
    assert "goodput (req/tick)" not in rows
    assert "unsent waste (tokens)" not in rows
    assert "finished: stop" not in rows


def test_goodput_and_reason_rows_when_present(continuous: list[Timeline], static: list[Timeline]) -> None:
    cancelled = Timeline("X", 0.0, 1)
    cancelled.record_finished(1.0, FinishReason.CANCELLED)
    rows = _table(
        format_compare_table(
            {
                "static": summarize(static, time_unit="tick", slo=SLO(ttft=3)),
                "continuous": summarize([*continuous, cancelled], time_unit="tick", unsent_tokens=4),
            }
        )
    )
    assert rows["goodput (req/tick)"] == [format_number(2 / 11), "-"]
    assert rows["SLO attainment"] == ["0.6667", "-"]
    assert rows["finished: cancelled"] == ["0", "1"]
    assert rows["unsent waste (tokens)"] == ["0", "4"]


def test_requests_that_never_ran_are_counted_under_requests(continuous: list[Timeline]) -> None:
    rejected = Timeline("R", 1.0, 1)
    rejected.record_finished(1.0, FinishReason.REJECTED)
    text = format_compare_table(
        {
            "all ran": summarize(continuous, time_unit="tick"),
            "one not": summarize([*continuous, rejected], time_unit="tick"),
        }
    )
    lines = text.splitlines()
    (index,) = [i for i, line in enumerate(lines) if line.startswith("requests ")]
    assert lines[index + 1].split() == ["never", "ran", "(left", "out", "of", "latencies)", "0", "1"]
    assert lines[index + 1].startswith("  ")  # indented under "requests"
    assert _table(text)["finished: rejected"] == ["0", "1"]
    assert "never ran" not in format_summary(summarize(continuous, time_unit="tick"))  # only when some run has one


def test_format_summary_in_seconds(continuous: list[Timeline]) -> None:
    text = format_summary(summarize(continuous, time_unit="s"), name="continuous")
    assert text.splitlines()[0].split() == ["metric", "continuous"]
    rows = _table(text)
    assert rows["makespan (s)"] == ["8"]
    assert rows["throughput (tok/s)"] == ["1.375"]
    assert rows["mean TTFT (ms)"] == ["2000"]
    assert not any(label.endswith("(ticks)") for label in rows)


def test_mixed_units_and_empty_are_errors(continuous: list[Timeline]) -> None:
    with pytest.raises(ValueError, match="time units"):
        format_compare_table({"a": summarize(continuous, time_unit="s"), "b": summarize(continuous, time_unit="tick")})
    with pytest.raises(ValueError, match="at least one"):
        format_compare_table({})
