"""The Vidur trace-replay CSV importer: columns, arrivals as given, ids, sniffing, errors."""

from __future__ import annotations

import pytest

from contbatch.traces import TraceError, import_vidur_csv, load_jsonl, load_trace, write_jsonl

from ._helpers import WriteFile, assert_located

HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens\n"


def test_import_rows(write_file: WriteFile) -> None:
    text = HEADER + "0.0,512,128\n0.25,1024,8\n\n0.25,7,1\n3,100,50\n"
    trace = import_vidur_csv(write_file("v.csv", text))
    assert [r.request_id for r in trace] == ["vidur-0", "vidur-1", "vidur-2", "vidur-3"]
    assert [r.arrival_ts for r in trace] == [0.0, 0.25, 0.25, 3.0]
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in trace] == [(512, 128), (1024, 8), (7, 1), (100, 50)]
    assert (trace.name, trace.time_unit) == ("v", "s")
    assert "Vidur" in trace.source


def test_arrivals_are_kept_as_given_and_sorted_stably(write_file: WriteFile) -> None:
    text = HEADER + "5.5,1,1\n2,2,2\n5.5,3,3\n"
    trace = import_vidur_csv(write_file("v.csv", text))
    assert [(r.request_id, r.arrival_ts) for r in trace] == [("vidur-1", 2.0), ("vidur-0", 5.5), ("vidur-2", 5.5)]


def test_extra_columns_and_any_order(write_file: WriteFile) -> None:
    text = ",num_decode_tokens,pd_ratio,arrived_at,num_total_tokens,num_prefill_tokens\n0,10,0.1,1.5,110,100\n"
    request = import_vidur_csv(write_file("v.csv", text)).requests[0]
    assert (request.arrival_ts, request.num_prompt_tokens, request.num_output_tokens) == (1.5, 100, 10)


def test_pandas_float_token_counts(write_file: WriteFile) -> None:
    request = import_vidur_csv(write_file("v.csv", HEADER + "1e-1,12.0,3.\n")).requests[0]
    assert (request.arrival_ts, request.num_prompt_tokens, request.num_output_tokens) == (0.1, 12, 3)


def test_load_trace_sniffs_the_header_and_jsonl_round_trips(write_file: WriteFile) -> None:
    path = write_file("vid.csv", HEADER + "0,5,6\n1.5,7,8\n")
    trace = load_trace(str(path))
    assert trace == import_vidur_csv(path)
    out = write_file("vid.jsonl", "")
    write_jsonl(trace, out)
    assert load_jsonl(out).requests == trace.requests


@pytest.mark.parametrize(
    ("row", "field", "fragment"),
    [
        ("x,1,1", "arrived_at", "must be a number"),
        (",1,1", "arrived_at", "missing"),
        ("-1,1,1", "arrived_at", ">= 0"),
        ("1,0,1", "num_prefill_tokens", ">= 1"),
        ("1,1,0", "num_decode_tokens", ">= 1"),
        ("1,1.5,1", "num_prefill_tokens", "integer"),
        ("1,1,many", "num_decode_tokens", "integer"),
        ("1,1", None, "row has 2 cells"),
    ],
)
def test_bad_row_names_file_line_field(write_file: WriteFile, row: str, field: str | None, fragment: str) -> None:
    path = write_file("v.csv", HEADER + "0,1,1\n" + row + "\n")
    with pytest.raises(TraceError) as info:
        import_vidur_csv(path)
    assert_located(info.value, path, 3, field)
    assert fragment in info.value.problem


@pytest.mark.parametrize(
    ("header", "field", "fragment"),
    [
        ("arrived_at,num_prefill_tokens\n", "num_decode_tokens", "missing required column"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens,arrived_at\n", "arrived_at", "twice"),
    ],
)
def test_bad_header(write_file: WriteFile, header: str, field: str, fragment: str) -> None:
    path = write_file("v.csv", header)
    with pytest.raises(TraceError) as info:
        import_vidur_csv(path)
    assert_located(info.value, path, 1, field)
    assert fragment in info.value.problem


@pytest.mark.parametrize("text", ["", HEADER])
def test_empty(write_file: WriteFile, text: str) -> None:
    path = write_file("v.csv", text)
    with pytest.raises(TraceError, match="empty") as info:
        import_vidur_csv(path)
    assert_located(info.value, path, None, None)
