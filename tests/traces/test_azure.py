"""The Azure LLM inference trace 2023 importer: exact timestamps, ids, sorting, errors."""

from __future__ import annotations

import pytest

from contbatch.traces import TraceError, import_azure_csv
from contbatch.traces.azure import parse_timestamp_ns

from ._helpers import WriteFile, assert_located

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"


def test_import_exact_arrivals(write_file: WriteFile) -> None:
    text = (
        HEADER + "2023-11-16 18:17:03.9799600,4808,10\r\n"
        "2023-11-16 18:17:04.0319601,3180,8\r\n"
        "2023-11-16 18:17:04.0319601,110,27\r\n"
        "2023-11-17 00:00:00,7,1"
    )
    trace = import_azure_csv(write_file("az.csv", text))
    assert [r.request_id for r in trace] == ["azure-0", "azure-1", "azure-2", "azure-3"]
    assert [r.arrival_ts for r in trace] == [0.0, 0.0520001, 0.0520001, 20576.02004]
    assert (trace.requests[0].num_prompt_tokens, trace.requests[0].num_output_tokens) == (4808, 10)
    assert (trace.time_unit, trace.name) == ("s", "az")


def test_unsorted_rows_sort_stably_from_the_earliest(write_file: WriteFile) -> None:
    text = HEADER + "2023-11-16 00:00:02,1,1\n2023-11-16 00:00:01,1,1\n2023-11-16 00:00:02,2,2\n"
    trace = import_azure_csv(write_file("az.csv", text))
    assert [(r.request_id, r.arrival_ts) for r in trace] == [
        ("azure-1", 0.0),
        ("azure-0", 1.0),
        ("azure-2", 1.0),
    ]


def test_column_order_is_free(write_file: WriteFile) -> None:
    text = "GeneratedTokens,TIMESTAMP,ContextTokens\n10,2023-11-16 18:17:03.97996,4808\n"
    request = import_azure_csv(write_file("az.csv", text)).requests[0]
    assert (request.num_prompt_tokens, request.num_output_tokens) == (4808, 10)


def test_timestamp_is_exact_beyond_microseconds() -> None:
    a = parse_timestamp_ns("2023-11-16 18:17:03.9799600")
    b = parse_timestamp_ns("2023-11-16 18:17:03.9799601")
    assert b - a == 100
    assert parse_timestamp_ns("2023-11-16T18:17:04") - a == 20_040_000
    assert parse_timestamp_ns("0001-01-01 00:00:00.000000001") == 1


@pytest.mark.parametrize(
    "stamp",
    [
        "2023-11-16",
        "2023-13-01 00:00:00",
        "2023-11-16 24:00:00",
        "2023-11-16 18:17:03.1234567890",
        "yesterday",
    ],
)
def test_bad_timestamps(stamp: str) -> None:
    with pytest.raises(ValueError):
        parse_timestamp_ns(stamp)


@pytest.mark.parametrize(
    ("row", "field", "fragment"),
    [
        ("2023-11-16 18:17:3.5,1,1", "TIMESTAMP", "not a timestamp"),
        ("2023-02-30 18:17:03,1,1", "TIMESTAMP", "not a timestamp"),
        ("2023-11-16 18:17:04,0,1", "ContextTokens", ">= 1"),
        ("2023-11-16 18:17:04,1,1.5", "GeneratedTokens", "integer"),
        ("2023-11-16 18:17:04,,1", "ContextTokens", "missing"),
        ("2023-11-16 18:17:04,1", None, "row has 2 cells"),
    ],
)
def test_bad_row_names_file_line_field(write_file: WriteFile, row: str, field: str | None, fragment: str) -> None:
    path = write_file("az.csv", HEADER + "2023-11-16 18:17:03,1,1\r\n" + row + "\r\n")
    with pytest.raises(TraceError) as info:
        import_azure_csv(path)
    assert_located(info.value, path, 3, field)
    assert fragment in info.value.problem


def test_bad_header(write_file: WriteFile) -> None:
    path = write_file("az.csv", "TIMESTAMP,ContextTokens,Tokens\n")
    with pytest.raises(TraceError) as info:
        import_azure_csv(path)
    assert_located(info.value, path, 1, "Tokens")


@pytest.mark.parametrize("text", ["", HEADER])
def test_empty(write_file: WriteFile, text: str) -> None:
    path = write_file("az.csv", text)
    with pytest.raises(TraceError, match="empty") as info:
        import_azure_csv(path)
    assert_located(info.value, path, None, None)
