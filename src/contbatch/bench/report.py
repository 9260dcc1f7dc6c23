"""Benchmark results: client-side timelines summarized by `contbatch.metrics.summarize`.

Which requests count: those scheduled at or after (first scheduled send + ``warmup_s``) and at
or before (last scheduled send - ``cooldown_s``); the others were sent (they load the server)
but are left out of every aggregate. Latencies are from the scheduled send time; the queue
statistics (``mean_queue_ms`` ...) are the client's own queue time (actual - scheduled send).
Latency statistics cover the measured requests that ran, by the rule of `contbatch.metrics`
(`RequestMetrics.ran`), the one `contbatch simulate` uses: a request the server refused (HTTP 429,
``rejected``) enters no latency, and is counted in ``num_rejected`` and ``finish_reasons``
instead (and in ``failed``, and as a goodput miss). The client cannot see the server's queue,
so a request sent and then cancelled or timed out before its first token counts as run here.

The result document uses `vllm bench serve`'s key names (``duration``, ``completed``,
``request_throughput``, ``output_throughput``, ``mean_ttft_ms``, ``p99_tpot_ms``,
``request_goodput``, ``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``errors``) plus
contbatch's (``finish_reasons``, ``slo_attainment``, ``num_excluded`` ...). Per-request rows
(`request_rows`) add the client's fields to `contbatch.metrics.request_rows`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from contbatch.bench.client import RequestRecord
from contbatch.core.timeline import Timeline
from contbatch.metrics import SLO, format_summary, request_rows, summarize

GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}


class BenchError(ValueError):
    """Results cannot be computed (e.g. warmup and cooldown leave no request)."""


def parse_goodput(items: Sequence[str]) -> SLO:
    """`["ttft:500", "tpot:50", "e2el:10000"]` (milliseconds) -> an `SLO` in seconds."""
    values: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise BenchError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            ms = float(raw)
        except ValueError:
            raise BenchError(f"--goodput {key}: not a number of milliseconds: {raw!r}") from None
        if not ms >= 0:
            raise BenchError(f"--goodput {key}: must be >= 0 ms, got {raw}")
        values[GOODPUT_KEYS[key]] = ms / 1000.0
    return SLO(**values)


def measured(
    records: Sequence[RequestRecord], *, warmup_s: float = 0.0, cooldown_s: float = 0.0
) -> list[RequestRecord]:
    if not records:
        return []
    first = min(r.scheduled_ts for r in records)
    last = max(r.scheduled_ts for r in records)
    lo, hi = first + warmup_s, last - cooldown_s
    return [r for r in records if lo <= r.scheduled_ts <= hi]


def summarize_records(
    records: Sequence[RequestRecord],
    *,
    warmup_s: float = 0.0,
    cooldown_s: float = 0.0,
    slo: SLO | None = None,
    run_info: Mapping[str, object] | None = None,
) -> dict[str, object]:
    kept = measured(records, warmup_s=warmup_s, cooldown_s=cooldown_s)
    if not kept:
        raise BenchError(
            f"no request is left to measure: --warmup {warmup_s:g} and --cooldown {cooldown_s:g} exclude all "
            f"{len(records)} requests"
        )
    timelines = [r.timeline() for r in kept]
    summary = summarize(timelines, time_unit="s", slo=slo)
    doc: dict[str, object] = dict(run_info or {})
    doc.update(summary)
    doc["num_prompts"] = len(records)
    doc["num_excluded"] = len(records) - len(kept)
    doc["failed"] = sum(1 for r in kept if r.finish is None or r.finish.value not in ("length", "stop"))
    if slo is not None:
        doc["request_goodput"] = summary.get("goodput")
    doc.update(_lists(kept, timelines))
    return doc


def _lists(records: Sequence[RequestRecord], timelines: Sequence[Timeline]) -> dict[str, object]:
    ttfts: list[float | None] = []
    itls: list[list[float]] = []
    for tl in timelines:
        ttfts.append(tl.token_ts[0] - tl.arrival_ts if tl.token_ts else None)
        itls.append([b - a for a, b in zip(tl.token_ts, tl.token_ts[1:], strict=False)])
    return {
        "input_lens": [r.num_prompt_tokens for r in records],
        "output_lens": [r.num_output_tokens for r in records],
        "ttfts": ttfts,
        "itls": itls,
        "errors": [r.error for r in records],
    }


def request_records(
    records: Sequence[RequestRecord], *, warmup_s: float = 0.0, cooldown_s: float = 0.0
) -> list[dict[str, object]]:
    """One JSON-ready row per request (all of them, `measured` says which count)."""
    kept = {id(r) for r in measured(records, warmup_s=warmup_s, cooldown_s=cooldown_s)}
    by_id = {r.request_id: r for r in records}
    rows = request_rows([r.timeline() for r in records], with_tokens=True)
    for row in rows:
        record = by_id[str(row["request_id"])]
        row["scheduled_ts"] = record.scheduled_ts
        row["send_ts"] = record.send_ts
        row["client_queue_time"] = None if record.send_ts is None else max(0.0, record.send_ts - record.scheduled_ts)
        row["http_status"] = record.status
        row["error"] = record.error
        row["measured"] = id(record) in kept
    return rows


def write_results(
    doc: Mapping[str, object], rows: Sequence[Mapping[str, object]], path: str | os.PathLike[str]
) -> Path:
    """Write the result JSON at `path` and the per-request JSONL beside it; returns the JSONL path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    jsonl = out.with_suffix(".requests.jsonl")
    with jsonl.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=False) + "\n")
    return jsonl


def to_text(doc: Mapping[str, object]) -> str:
    head = [
        f"target: {doc.get('base_url')}  model: {doc.get('model_id')}  endpoint: {doc.get('endpoint')}",
        f"requests: {doc.get('num_prompts')} sent, {doc.get('num_excluded')} excluded (warmup/cooldown), "
        f"{doc.get('completed')} completed, {doc.get('failed')} failed",
        "",
    ]
    return "\n".join(head) + format_summary(doc, name="bench")
