"""contbatch: continuous batching, measured.

One iteration-level scheduler (`contbatch.core`) driven by a discrete-event simulator
(`contbatch.sim`), one metrics library (`contbatch.metrics`) computing every latency and
throughput figure from per-request timelines, and a CLI (`contbatch.cli`).
"""

from contbatch.compiled import install as _install_compiled

__version__ = "0.1.0"

_install_compiled()  # before anything imports the modules it may load compiled
