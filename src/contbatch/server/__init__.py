"""contbatch.server: the OpenAI-compatible server over the scheduler.

Layers, top down: `app` (FastAPI routes) and `serving` (one generation request: validation in
`protocol`, response bodies in `formats`) talk only to an `EngineClient` (`client`); its one
implementation runs a `Driver` (`driver`: the scheduler loop on one thread, in real time; events
reach asyncio through `delivery`) over a backend's `Executor` (`executor` states the protocol;
`backends`: `sim`, the paced simulator, or `engine`, the real PyTorch engine imported lazily).
`metrics` exposes Prometheus metrics from the driver's snapshots and finished timelines. The
server imports core types and asyncio, never torch.
"""
