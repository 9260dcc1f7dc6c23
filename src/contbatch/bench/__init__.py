"""contbatch.bench: a load generator for any OpenAI-compatible endpoint, reported by `contbatch.metrics`.

`workload` builds what to send and when (a trace, or synthetic Poisson/gamma arrivals);
`runner` sends it over HTTP (aiohttp, streaming) at the scheduled times under a concurrency
limit; `client` records each request's client-side timeline; `report` summarizes the
timelines with `contbatch.metrics.summarize` under `vllm bench serve`'s key names; `servers`
starts a server under test as a child process (a free port, healthy before use, stopped after),
for the benchmarks and tests that drive one. It imports
the metrics, the trace schema and an HTTP client, never the scheduler, the engine or the
simulator.
"""
