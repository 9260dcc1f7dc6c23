"""A backend's load from its Prometheus `/metrics`: waiting and running requests, KV usage.

Parsed with `prometheus_client`'s text parser. The gauges are found by their name after the
namespace (``contbatch:num_requests_waiting`` and vLLM's ``vllm:num_requests_waiting`` alike),
summed over their label sets (a server of several models; KV usage: the largest); SGLang's names are known too:

| load | names |
|---|---|
| waiting requests | `num_requests_waiting`, `num_queue_reqs` |
| running requests | `num_requests_running`, `num_running_reqs` |
| KV usage (0 to 1) | `kv_cache_usage_perc`, `gpu_cache_usage_perc`, `token_usage` |

A server that exports neither request gauge gives no scrape (None): routers then use the
gateway's own in-flight counts (`contbatch.routing.ReplicaView.num_waiting`). A missing KV gauge
reads 0.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from contbatch.routing import Scrape

WAITING = ("num_requests_waiting", "num_queue_reqs")
RUNNING = ("num_requests_running", "num_running_reqs")
KV_USAGE = ("kv_cache_usage_perc", "gpu_cache_usage_perc", "token_usage")
_KIND = {name: kind for kind, names in (("waiting", WAITING), ("running", RUNNING), ("kv", KV_USAGE)) for name in names}


def parse_scrape(text: str, ts: float) -> Scrape | None:
    """The load in a `/metrics` text, as a `Scrape` taken at `ts`; None when it has no request
    gauge or cannot be parsed."""
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            kind = _KIND.get(family.name.rsplit(":", 1)[-1])
            if kind is None:
                continue
            values = [s.value for s in family.samples if s.name == family.name and math.isfinite(s.value)]
            if values:  # counts add up over label sets; KV usage is the fullest one's
                total = max(values) if kind == "kv" else sum(values)
                found[kind] = max(found.get(kind, 0.0), total) if kind == "kv" else found.get(kind, 0.0) + total
    except (ValueError, TypeError, IndexError):  # not Prometheus text
        return None
    if "waiting" not in found and "running" not in found:
        return None
    kv = found.get("kv", 0.0)
    return Scrape(
        ts,
        max(0, round(found.get("waiting", 0.0))),
        max(0, round(found.get("running", 0.0))),
        min(1.0, max(0.0, kv)),
    )
