"""Streaming summaries: fold finished timelines one at a time and keep no token timestamps.

For runs too large to keep every timeline (a million requests): each finished timeline becomes
one compact `RequestMetrics` row (its inter-token gaps dropped from the row) and its gaps are
appended to two pooled float arrays (8 bytes a gap), so memory grows with requests and tokens
but not with timeline objects. `summary()` gives exactly what `summarize` gives for the same
timelines (same definitions, same numbers): in particular the same rule for which requests a
latency covers (`RequestMetrics.ran`: only gaps of requests that ran are pooled, and every other
latency is filtered by `summarize_rows` itself).
"""

from __future__ import annotations

import dataclasses
from array import array

from contbatch.core.timeline import Timeline
from contbatch.metrics.request import RequestMetrics, request_metrics
from contbatch.metrics.summary import SLO, summarize_rows


class StreamingSummary:
    def __init__(self) -> None:
        self.rows: list[RequestMetrics] = []
        self._itl_per_emission = array("d")
        self._itl_per_token = array("d")

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, timeline: Timeline) -> None:
        """Fold one finished timeline (ValueError if it has not finished)."""
        m = request_metrics(timeline)
        if m.ran:  # the latency rule of `summarize`: a request that did not run has no gaps to pool
            self._itl_per_emission.extend(m.itl_per_emission)
            self._itl_per_token.extend(m.itl_per_token)
        self.rows.append(dataclasses.replace(m, itl_per_emission=(), itl_per_token=()))

    def summary(
        self, *, time_unit: str, padding_tokens: int = 0, unsent_tokens: int = 0, slo: SLO | None = None
    ) -> dict[str, object]:
        return summarize_rows(
            self.rows,
            time_unit=time_unit,
            padding_tokens=padding_tokens,
            unsent_tokens=unsent_tokens,
            slo=slo,
            itls=(self._itl_per_emission, self._itl_per_token),
        )
