"""Per-request export: round-trips, ordering, determinism."""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from contbatch.core.status import FinishReason
from contbatch.core.timeline import Timeline
from contbatch.metrics import REQUEST_COLUMNS, request_metrics, write_requests_csv, write_requests_jsonl

MakeTimeline = Callable[..., Timeline]


@pytest.fixture
def mixed(make_tl: MakeTimeline) -> list[Timeline]:
    return [
        make_tl(
            "b",
            0.1,
            scheduled=[0.1 + 0.2, 0.9],
            preempted=[0.5],
            tokens=[0.4, 1.0, 1.3],
            counts=[1, 2, 3],
            finished=1.3,
            reason=FinishReason.STOP,
            tenant="t1",
            priority=2,
            num_prompt_tokens=17,
        ),
        make_tl("a", 0.1, scheduled=[0.2], tokens=[0.7], finished=0.8, tenant="t2"),
        make_tl("c", 0.0, finished=0.05, reason=FinishReason.REJECTED),
    ]


def test_jsonl_round_trip(tmp_path: Path, mixed: list[Timeline]) -> None:
    path = tmp_path / "requests.jsonl"
    write_requests_jsonl(mixed, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["request_id"] for r in rows] == ["c", "a", "b"]  # by arrival, then id
    by_id = {tl.request_id: tl for tl in mixed}
    for row in rows:
        tl = by_id[row["request_id"]]
        assert tuple(row)[: len(REQUEST_COLUMNS)] == REQUEST_COLUMNS
        assert row["token_ts"] == tl.token_ts
        assert row["token_counts"] == tl.token_counts
        expected = request_metrics(tl).as_row()
        assert {k: row[k] for k in REQUEST_COLUMNS} == expected
    b = rows[2]
    assert b["arrival_ts"] == 0.1
    assert b["first_scheduled_ts"] == 0.1 + 0.2  # exact float, not a rounded one
    assert b["num_preemptions"] == 1
    assert b["num_output_tokens"] == 6
    assert b["finish_reason"] == "stop"
    assert rows[0]["ttft"] is None
    assert rows[0]["first_token_ts"] is None


def test_csv_round_trip(tmp_path: Path, mixed: list[Timeline]) -> None:
    path = tmp_path / "requests.csv"
    write_requests_csv(mixed, path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == REQUEST_COLUMNS
        rows = list(reader)
    assert [r["request_id"] for r in rows] == ["c", "a", "b"]
    metrics = {tl.request_id: request_metrics(tl) for tl in mixed}
    for row in rows:
        m = metrics[row["request_id"]]
        assert float(row["arrival_ts"]) == m.arrival_ts
        assert float(row["finished_ts"]) == m.completion_ts
        assert float(row["e2e"]) == m.e2e
        assert int(row["num_output_tokens"]) == m.num_output_tokens
        assert row["finish_reason"] == m.finish_reason.value
        assert (row["ttft"] == "") == (m.ttft is None)
        if m.ttft is not None:
            assert float(row["ttft"]) == m.ttft
    assert rows[0]["tenant"] == ""
    assert rows[2]["first_scheduled_ts"] == repr(0.1 + 0.2)


def test_output_is_deterministic(tmp_path: Path, mixed: list[Timeline]) -> None:
    shuffled = mixed[:]
    random.Random(7).shuffle(shuffled)
    for writer, name in ((write_requests_jsonl, "r.jsonl"), (write_requests_csv, "r.csv")):
        writer(mixed, tmp_path / f"1{name}")
        writer(shuffled, tmp_path / f"2{name}")
        assert (tmp_path / f"1{name}").read_bytes() == (tmp_path / f"2{name}").read_bytes()


def test_unfinished_is_an_error(tmp_path: Path, make_tl: MakeTimeline) -> None:
    with pytest.raises(ValueError, match="'open'"):
        write_requests_jsonl([make_tl("open", 0.0, tokens=[1.0])], tmp_path / "x.jsonl")
