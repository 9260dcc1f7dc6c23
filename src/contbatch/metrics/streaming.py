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

import operator
from array import array
from itertools import islice

from contbatch.core.timeline import Timeline
from contbatch.metrics.request import RequestMetrics, itls, request_metrics
from contbatch.metrics.summary import SLO, summarize_rows


class StreamingSummary:
    """Invariant: while every emission folded so far carried one token, the per-token gaps are
    the per-emission gaps and one array holds both (`_itl_per_token` is `_itl_per_emission`: the
    summary then describes one sample); the first emission of several tokens splits them."""

    def __init__(self) -> None:
        self.rows: list[RequestMetrics] = []
        self._itl_per_emission = array("d")
        self._itl_per_token = self._itl_per_emission

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, timeline: Timeline) -> None:
        """Fold one finished timeline (ValueError if it has not finished)."""
        m = request_metrics(timeline, with_itls=False)
        if m.ran:  # the latency rule of `summarize`: a request that did not run has no gaps to pool
            self._pool_gaps(timeline)
        self.rows.append(m)

    def _pool_gaps(self, timeline: Timeline) -> None:
        stamps, counts = timeline.token_ts, timeline.token_counts
        one_each = counts.count(1) == len(counts)
        if one_each and self._itl_per_token is self._itl_per_emission:
            self._itl_per_emission.extend(map(operator.sub, islice(stamps, 1, None), stamps))
            return
        if self._itl_per_token is self._itl_per_emission:
            self._itl_per_token = array("d", self._itl_per_emission)
        per_emission, per_token = itls(timeline)
        self._itl_per_emission.extend(per_emission)
        self._itl_per_token.extend(per_token)

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
