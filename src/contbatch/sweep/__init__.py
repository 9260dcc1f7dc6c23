"""contbatch.sweep: a grid of simulator runs from one YAML file, one results table out.

A sweep file (`contbatch.sweep.spec` states the schema) names a trace (optionally rescaled to one
or more request rates), a cost model or several, a preset with ``--set``-style overrides, and
grid axes: lists of values for the scheduler, the cost model, the rate or any scheduler config
key. The grid is the cartesian product of the axes; each point is one `simulate` run of the
trace, summarized as ``contbatch simulate`` summarizes it (`contbatch.sweep.point`). Points run
in a local process pool or on a Ray cluster (`contbatch.sweep.run`); the results table has one
row per point in grid order, identical whichever runner produced it (`contbatch.sweep.results`).

Typical use::

    spec = load_sweep("examples/sweep.yaml")
    result = run_local(spec, workers=4)          # or run_ray(spec, address="auto")
    write_results(result, "out/")                # out/sweep.csv, out/sweep.json
    write_sweep_plots(result, "plots/")
"""

from contbatch.sweep._reader import SweepError
from contbatch.sweep.columns import default_metrics, metric_name, with_plot_metric
from contbatch.sweep.figures import write_sweep_plots
from contbatch.sweep.point import PointTask, run_point
from contbatch.sweep.results import columns, document, rows, text_table, to_json, write_results
from contbatch.sweep.run import RayUnavailable, SweepResult, run_local, run_ray
from contbatch.sweep.spec import Axis, GridPoint, SweepSpec, load_sweep, parse_sweep

__all__ = [
    "Axis",
    "GridPoint",
    "PointTask",
    "RayUnavailable",
    "SweepError",
    "SweepResult",
    "SweepSpec",
    "columns",
    "default_metrics",
    "document",
    "load_sweep",
    "metric_name",
    "parse_sweep",
    "rows",
    "run_local",
    "run_point",
    "run_ray",
    "text_table",
    "to_json",
    "with_plot_metric",
    "write_results",
    "write_sweep_plots",
]
