"""contbatch: continuous batching, measured.

One iteration-level scheduler (`contbatch.core`) driven by a discrete-event simulator
(`contbatch.sim`), one metrics library (`contbatch.metrics`) computing every latency and
throughput figure from per-request timelines, and a CLI (`contbatch.cli`).
"""

__version__ = "0.1.0"
