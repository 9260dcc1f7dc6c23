"""The BurstGPT CSV importer: failures skipped and counted, arrivals from the earliest, the model
as tenant, sniffing, errors."""

from __future__ import annotations

import pytest

from contbatch.traces import TraceError, import_burstgpt_csv, load_jsonl, load_trace, write_jsonl

from ._helpers import WriteFile, assert_located

HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def test_import_rows_skipping_failures(write_file: WriteFile) -> None:
    text = (
        HEADER + "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n"
        "\n"
        "118.5,ChatGPT,1260,0,1260,API log\n"
        "200.25,ChatGPT,20,1,21,API log\n"
    )
    trace = import_burstgpt_csv(write_file("b.csv", text))
    assert [r.request_id for r in trace] == ["burstgpt-0", "burstgpt-2", "burstgpt-4"]
    assert [r.arrival_ts for r in trace] == [0.0, 113.0, 195.25]
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in trace] == [(472, 18), (417, 276), (20, 1)]
    assert [r.tenant for r in trace] == ["ChatGPT", "GPT-4", "ChatGPT"]
    assert "2 of 5 rows skipped as failures (zero response tokens)" in trace.source
    assert "\n" not in trace.source and (trace.name, trace.time_unit) == ("b", "s")


def test_arrivals_are_exact_differences(write_file: WriteFile) -> None:
    text = HEADER + "5184000.1,ChatGPT,1,1,2,API log\n5184000.3,ChatGPT,1,1,2,API log\n"
    trace = import_burstgpt_csv(write_file("b.csv", text))
    assert [r.arrival_ts for r in trace] == [0.0, 0.2]  # not 0.19999999925494194


def test_columns_in_any_order_extra_ignored_model_optional(write_file: WriteFile) -> None:
    text = "Response tokens,SessionID,Request tokens,Timestamp\n9,abc,10,3\n4,abc,5,1\n"
    trace = import_burstgpt_csv(write_file("b.csv", text))
    assert [(r.request_id, r.arrival_ts, r.num_prompt_tokens, r.tenant) for r in trace] == [
        ("burstgpt-1", 0.0, 5, None),
        ("burstgpt-0", 2.0, 10, None),
    ]
    assert "0 of 2 rows skipped" in trace.source


def test_load_trace_sniffs_the_header_and_jsonl_round_trips(write_file: WriteFile) -> None:
    path = write_file("burst.csv", HEADER + "1,ChatGPT,3,4,7,API log\n2,GPT-4,5,0,5,API log\n")
    trace = load_trace(str(path))
    assert trace == import_burstgpt_csv(path)
    assert len(trace) == 1 and "1 of 2 rows skipped" in trace.source
    out = write_file("burst.jsonl", "")
    write_jsonl(trace, out)
    assert load_jsonl(out).requests == trace.requests


def test_only_failures_is_an_error(write_file: WriteFile) -> None:
    path = write_file("b.csv", HEADER + "1,ChatGPT,3,0,3,API log\n")
    with pytest.raises(TraceError, match="all 1 rows are failures") as info:
        import_burstgpt_csv(path)
    assert_located(info.value, path, None, None)


@pytest.mark.parametrize(
    ("row", "field", "fragment"),
    [
        ("soon,ChatGPT,1,1,2,API log", "Timestamp", "must be a number"),
        (",ChatGPT,1,1,2,API log", "Timestamp", "missing"),
        ("1,ChatGPT,0,1,1,API log", "Request tokens", ">= 1"),
        ("1,ChatGPT,1,-3,1,API log", "Response tokens", ">= 1"),
        ("1,ChatGPT,1.5,1,1,API log", "Request tokens", "integer"),
        ("1,ChatGPT,1,lots,1,API log", "Response tokens", "integer"),
        ("1,ChatGPT,1,1", None, "row has 4 cells"),
    ],
)
def test_bad_row_names_file_line_field(write_file: WriteFile, row: str, field: str | None, fragment: str) -> None:
    path = write_file("b.csv", HEADER + "0,ChatGPT,1,1,2,API log\n" + row + "\n")
    with pytest.raises(TraceError) as info:
        import_burstgpt_csv(path)
    assert_located(info.value, path, 3, field)
    assert fragment in info.value.problem


def test_bad_header(write_file: WriteFile) -> None:
    path = write_file("b.csv", "Timestamp,Model,Request tokens,Response tokens,Response tokens\n")
    with pytest.raises(TraceError) as info:
        import_burstgpt_csv(path)
    assert_located(info.value, path, 1, "Response tokens")
    path = write_file("c.csv", "Model,Request tokens,Response tokens\n")
    with pytest.raises(TraceError, match="missing required column") as info:
        load_trace(str(path))
    assert_located(info.value, path, 1, "Timestamp")


@pytest.mark.parametrize("text", ["", HEADER])
def test_empty(write_file: WriteFile, text: str) -> None:
    path = write_file("b.csv", text)
    with pytest.raises(TraceError, match="empty") as info:
        import_burstgpt_csv(path)
    assert_located(info.value, path, None, None)
