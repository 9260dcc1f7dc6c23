"""Per-group results: summarize_by / service_by on hand-built timelines, and the group table."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, format_group_table, service_by, summarize, summarize_by

MakeTimeline = Callable[..., Timeline]
STOP = FinishReason.STOP


def _two_tenants(make_tl: MakeTimeline) -> list[Timeline]:
    """Makespan 0 -> 8 s; heavy: 2 requests, 5 tokens; light: 2 requests, 3 tokens; one rejected, no tenant."""
    heavy, light = {"tenant": "heavy"}, {"tenant": "light"}
    return [
        make_tl("h1", 0.0, scheduled=[0.0], tokens=[1.0, 2.0, 3.0], finished=3.0, num_prompt_tokens=100, **heavy),
        make_tl("h2", 0.0, scheduled=[0.5], tokens=[2.0, 4.0], finished=4.0, num_prompt_tokens=50, **heavy),
        make_tl("l1", 1.0, scheduled=[1.0], tokens=[1.5], finished=1.5, num_prompt_tokens=10, **light),
        make_tl("l2", 5.0, scheduled=[5.0], tokens=[6, 8], finished=8.0, num_prompt_tokens=20, **light, reason=STOP),
        make_tl("n1", 2.0, finished=2.0, reason=FinishReason.REJECTED, num_prompt_tokens=30),
    ]


def test_groups_are_sorted_with_no_tenant_first(make_tl: MakeTimeline) -> None:
    groups = summarize_by(_two_tenants(make_tl), "tenant", time_unit="s")
    assert list(groups) == ["-", "heavy", "light"]


def test_group_summary_is_compact_with_ms_keys(make_tl: MakeTimeline) -> None:
    heavy = summarize_by(_two_tenants(make_tl), "tenant", time_unit="s")["heavy"]
    assert set(heavy) == {
        "time_unit",
        "num_requests",
        "completed",
        "finish_reasons",
        "total_output_tokens",
        "output_throughput",
        *(f"{p}_ttft_ms" for p in ("mean", "median", "p90", "p99", "max")),
        *(f"{p}_tpot_ms" for p in ("mean", "median", "p99")),
        *(f"{p}_e2el_ms" for p in ("mean", "median", "p99")),
    }
    assert (heavy["num_requests"], heavy["completed"], heavy["total_output_tokens"]) == (2, 2, 5)
    assert heavy["finish_reasons"] == {"length": 2}  # non-zero reasons only
    assert heavy["mean_ttft_ms"] == pytest.approx(1500.0)  # TTFTs 1 s and 2 s
    assert heavy["max_ttft_ms"] == pytest.approx(2000.0)
    assert heavy["mean_tpot_ms"] == pytest.approx(1500.0)  # (3-1)/2 = 1 s and (4-2)/1 = 2 s
    assert heavy["mean_e2el_ms"] == pytest.approx(3500.0)
    assert heavy["output_throughput"] == pytest.approx(5 / 8)  # over the whole run's makespan


def test_failed_and_tokenless_groups(make_tl: MakeTimeline) -> None:
    groups = summarize_by(_two_tenants(make_tl), "tenant", time_unit="s")
    none = groups["-"]
    assert (none["num_requests"], none["completed"], none["finish_reasons"]) == (1, 0, {"rejected": 1})
    assert none["mean_ttft_ms"] is None and none["mean_tpot_ms"] is None
    assert none["output_throughput"] == 0.0
    light = groups["light"]
    assert light["finish_reasons"] == {"length": 1, "stop": 1}
    assert light["mean_tpot_ms"] == pytest.approx(2000.0)  # l1 has one token: no TPOT
    json.dumps(groups, allow_nan=False)


def test_group_latencies_leave_out_requests_that_did_not_run(make_tl: MakeTimeline) -> None:
    """Issue 14: a rejection is counted, but enters no group latency (no E2E of 0)."""
    tls = [
        make_tl("ok", 0.0, scheduled=[0.0], tokens=[1.0, 2.0], finished=3.0, tenant="t"),
        make_tl("rej", 0.0, finished=0.0, reason=FinishReason.REJECTED, tenant="t"),
        make_tl("alone", 1.0, finished=1.0, reason=FinishReason.REJECTED, tenant="u"),
    ]
    groups = summarize_by(tls, "tenant", time_unit="tick")
    assert groups["t"]["finish_reasons"] == {"length": 1, "rejected": 1}
    assert groups["t"]["mean_e2el_ticks"] == groups["t"]["p99_e2el_ticks"] == 3.0
    assert groups["u"]["mean_e2el_ticks"] is None and groups["u"]["median_e2el_ticks"] is None
    assert groups["t"]["p99_e2el_ticks"] == summarize(tls, time_unit="tick")["p99_e2el_ticks"]


def test_group_throughput_and_goodput_add_up_to_the_run(make_tl: MakeTimeline) -> None:
    tls = _two_tenants(make_tl)
    slo = SLO(ttft=1.0)
    run = summarize(tls, time_unit="s", slo=slo)
    groups = summarize_by(tls, "tenant", time_unit="s", slo=slo)
    for key in ("output_throughput", "goodput", "goodput_tokens"):
        assert sum(g[key] for g in groups.values()) == pytest.approx(run[key])  # type: ignore[misc]
    assert sum(g["num_requests"] for g in groups.values()) == run["num_requests"]  # type: ignore[misc]


def test_slo_keys_per_group(make_tl: MakeTimeline) -> None:
    groups = summarize_by(_two_tenants(make_tl), "tenant", time_unit="s", slo=SLO(ttft=1.0))
    assert groups["heavy"]["slo_attainment"] == 0.5  # h2's TTFT is 2 s
    assert groups["heavy"]["goodput"] == pytest.approx(1 / 8)
    assert groups["heavy"]["goodput_tokens"] == pytest.approx(3 / 8)
    assert groups["light"]["slo_attainment"] == 1.0
    assert groups["-"]["slo_attainment"] == 0.0  # rejected: a miss
    assert "goodput" not in summarize_by(_two_tenants(make_tl), "tenant", time_unit="s")["heavy"]


def test_tick_unit_keys_are_unscaled(make_tl: MakeTimeline) -> None:
    tls = [make_tl("a", 0, scheduled=[0], tokens=[2, 3, 4], finished=4, tenant="t")]
    group = summarize_by(tls, "tenant", time_unit="tick")["t"]
    assert group["mean_ttft_ticks"] == 2.0
    assert group["p99_tpot_ticks"] == 1.0
    assert "mean_ttft_ms" not in group


def test_priorities_sort_as_numbers(make_tl: MakeTimeline) -> None:
    tls = [make_tl(f"r{p}", 0, scheduled=[0], tokens=[1], finished=1, priority=p) for p in (2, 10, 0, -1)]
    groups = summarize_by(tls, "priority", time_unit="tick")
    assert list(groups) == ["-1", "0", "2", "10"]
    assert list(service_by(tls, "priority")) == ["-1", "0", "2", "10"]


def test_single_group_matches_the_run(make_tl: MakeTimeline) -> None:
    tls = [
        make_tl("a", 0.0, scheduled=[0.0], tokens=[1.0, 2.0], finished=2.0),
        make_tl("b", 0.5, scheduled=[0.5], tokens=[3.0, 3.5, 4.0], finished=4.0),
    ]
    run = summarize(tls, time_unit="s")
    groups = summarize_by(tls, "tenant", time_unit="s")
    assert list(groups) == ["-"]
    for key, value in groups["-"].items():
        if key != "finish_reasons":
            assert value == run[key], key
    assert list(summarize_by(tls, "priority", time_unit="s")) == ["0"]


@pytest.mark.parametrize("key", ["model", "Tenant", ""])
def test_unknown_key_is_an_error(make_tl: MakeTimeline, key: str) -> None:
    tls = [make_tl("a", 0, scheduled=[0], tokens=[1], finished=1)]
    with pytest.raises(ValueError, match="cannot group by"):
        summarize_by(tls, key, time_unit="tick")
    with pytest.raises(ValueError, match="cannot group by"):
        service_by(tls, key)


def test_bad_inputs_raise_as_summarize_does(make_tl: MakeTimeline) -> None:
    with pytest.raises(ValueError, match="empty"):
        summarize_by([], "tenant", time_unit="s")
    with pytest.raises(ValueError, match="time_unit"):
        summarize_by([make_tl("a", 0, finished=1)], "tenant", time_unit="ms")
    with pytest.raises(ValueError, match="never finished"):
        summarize_by([make_tl("a", 0, scheduled=[0])], "tenant", time_unit="tick")
    with pytest.raises(ValueError, match="never finished"):
        service_by([make_tl("a", 0, scheduled=[0])], "tenant")


def test_service_counts_served_prompts_and_emitted_tokens(make_tl: MakeTimeline) -> None:
    tls = _two_tenants(make_tl)
    service = service_by(tls, "tenant")
    assert service == {"-": 0, "heavy": 100 + 50 + 5, "light": 10 + 20 + 3}  # rejected n1 was never served
    run = summarize(tls, time_unit="s")
    assert sum(service.values()) == run["total_input_tokens"] + run["total_output_tokens"]  # type: ignore[operator]
    assert service_by([], "tenant") == {}


def test_service_counts_tokens_of_cancelled_requests(make_tl: MakeTimeline) -> None:
    tls = [make_tl("c", 0, scheduled=[0], tokens=[1, 2], finished=2, reason=FinishReason.CANCELLED, tenant="t")]
    assert service_by(tls, "tenant") == {"t": 1 + 2}


# -- the table -------------------------------------------------------------------------------


def _blocks(text: str) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """{block header label: (column names, {row label: cells})}."""
    blocks = {}
    for block in text.strip("\n").split("\n\n"):
        lines = block.splitlines()
        header = lines[0].split("  ")
        label, names = header[0].strip(), [h.strip() for h in header[1:] if h.strip()]
        rows = {}
        for line in lines[2:]:
            row_label, _, rest = line.partition("  ")
            rows[row_label.strip()] = rest.split()
        blocks[label] = (names, rows)
    return blocks


def test_group_table_puts_runs_side_by_side(make_tl: MakeTimeline) -> None:
    fcfs = summarize_by(_two_tenants(make_tl), "tenant", time_unit="s")
    light_only = [tl for tl in _two_tenants(make_tl) if tl.tenant == "light"]
    fair = summarize_by(light_only, "tenant", time_unit="s")
    blocks = _blocks(format_group_table({"fcfs": fcfs, "fair": fair}, "tenant"))
    assert list(blocks) == ["tenant -", "tenant heavy", "tenant light"]
    names, rows = blocks["tenant heavy"]
    assert names == ["fcfs", "fair"]
    assert rows["requests"] == ["2", "-"]  # fair has no heavy group
    assert rows["mean TTFT (ms)"] == ["1500", "-"]
    assert blocks["tenant light"][1]["requests"] == ["2", "2"]
    assert list(rows) == [
        "requests",
        "completed",
        "throughput (tok/s)",
        "mean TTFT (ms)",
        "p50 TTFT (ms)",
        "p99 TTFT (ms)",
        "mean TPOT (ms)",
        "p99 TPOT (ms)",
        "p99 E2E (ms)",
    ]


def test_group_table_shows_slo_rows_with_an_slo(make_tl: MakeTimeline) -> None:
    groups = summarize_by(_two_tenants(make_tl), "tenant", time_unit="s", slo=SLO(ttft=1.0))
    blocks = _blocks(format_group_table({"run": groups}, "tenant"))
    assert blocks["tenant heavy"][1]["goodput (req/s)"] == ["0.125"]
    assert blocks["tenant heavy"][1]["SLO attainment"] == ["0.5"]
    assert blocks["tenant -"][1]["SLO attainment"] == ["0"]  # shown at zero too


def test_group_table_in_ticks_and_priority_order(make_tl: MakeTimeline) -> None:
    tls = [make_tl(f"r{p}", 0, scheduled=[0], tokens=[2], finished=2, priority=p) for p in (10, 2)]
    text = format_group_table({"a": summarize_by(tls, "priority", time_unit="tick")}, "priority")
    blocks = _blocks(text)
    assert list(blocks) == ["priority 2", "priority 10"]
    assert blocks["priority 2"][1]["mean TTFT (ticks)"] == ["2"]
    assert "throughput (tok/tick)" in blocks["priority 10"][1]


def test_group_table_rejects_empty_and_mixed_units(make_tl: MakeTimeline) -> None:
    with pytest.raises(ValueError, match="at least one"):
        format_group_table({}, "tenant")
    with pytest.raises(ValueError, match="at least one"):
        format_group_table({"a": {}}, "tenant")
    tl = make_tl("a", 0, scheduled=[0], tokens=[1], finished=1)
    seconds = summarize_by([tl], "tenant", time_unit="s")
    ticks = summarize_by([tl], "tenant", time_unit="tick")
    with pytest.raises(ValueError, match="different time units"):
        format_group_table({"s": seconds, "t": ticks}, "tenant")
