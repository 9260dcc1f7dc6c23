"""contbatch.plots: figures of runs, drawn from per-request timelines and per-step records.

Plots are presentation only: every number comes from the timelines (`contbatch.core.timeline`)
through the metric definitions of `contbatch.metrics`, or from per-step records the simulator's
step observer collects (`StepSeries`). Each plot function writes ``<stem>.png`` and
``<stem>.svg`` into a directory (created if needed) and returns the two paths:

- `plot_request_timeline`: Gantt bars per request (waiting, requeued, prefill, decode, token
  ticks), several runs of one trace in panels sharing the time axis;
- `plot_latency_cdfs`: TTFT, TPOT and E2E CDFs, one line per run;
- `plot_capacity`: throughput/goodput and latency percentiles against request rate;
- `plot_steps`: KV usage, batch size and batched tokens over time;
- `plot_grid_metric`: one metric across a `contbatch.sweep` grid;
- `plot_fleet_load`, `plot_replica_count`, `plot_cost_goodput`: fleets (`contbatch.sim.cluster`):
  per-replica load and KV usage over time, replicas over time, cost against goodput;
- `write_run_plots`: the plots of one `contbatch simulate` / `compare --plot DIR`.

matplotlib is imported lazily inside the functions (Agg canvas, no pyplot): importing this
package does not import it.
"""

from contbatch.plots.capacity import plot_capacity
from contbatch.plots.cdf import latency_samples, plot_latency_cdfs
from contbatch.plots.fleet import plot_cost_goodput, plot_fleet_load, plot_replica_count
from contbatch.plots.grid import grid_layout, plot_grid_metric
from contbatch.plots.runs import MAX_TIMELINE_REQUESTS, write_run_plots
from contbatch.plots.steps import StepPoint, StepSeries, plot_steps
from contbatch.plots.timeline import PHASES, Segment, plot_request_timeline, request_segments

__all__ = [
    "MAX_TIMELINE_REQUESTS",
    "PHASES",
    "Segment",
    "StepPoint",
    "StepSeries",
    "grid_layout",
    "latency_samples",
    "plot_capacity",
    "plot_cost_goodput",
    "plot_fleet_load",
    "plot_grid_metric",
    "plot_latency_cdfs",
    "plot_replica_count",
    "plot_request_timeline",
    "plot_steps",
    "request_segments",
    "write_run_plots",
]
