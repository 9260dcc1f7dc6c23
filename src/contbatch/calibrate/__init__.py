"""Calibration: the simulator's cost model measured on the real engine, and its prediction error.

- `contbatch.calibrate.grid`: synthetic steps over a (prefill, decode, context) grid, timed on
  the model runner;
- `contbatch.calibrate.loop`: cycle times of the steps of a real engine run;
- `contbatch.calibrate.fit`: affine and table fits, the engine loop's extra time, errors (pure);
- `contbatch.calibrate.calibration`: `calibrate`, which runs all of it and chooses a fit by
  held-out error;
- `contbatch.calibrate.profile_doc`: the profile file (`contbatch.sim.costs.profile` reads it);
- `contbatch.calibrate.capacity`: capacity in the calibrated simulator, seeded workloads;
- `contbatch.calibrate.probe`: the machine's speed now against its speed at calibration;
- `contbatch.calibrate.validate`: engine against simulator on one trace, metric by metric.

This package joins the two executors, so it may import both `contbatch.engine` (and torch) and
`contbatch.sim`; neither of them imports it. matplotlib is imported only to plot.
"""

from contbatch.calibrate.calibration import Calibration, CalibrationConfig, calibrate
from contbatch.calibrate.fit import FitError, StepSample, fit_affine, fit_loop, fit_table
from contbatch.calibrate.grid import CalibrationError, GridSpec
from contbatch.calibrate.validate import Validation, format_validation, validate

__all__ = [
    "Calibration",
    "CalibrationConfig",
    "CalibrationError",
    "FitError",
    "GridSpec",
    "StepSample",
    "Validation",
    "calibrate",
    "fit_affine",
    "fit_loop",
    "fit_table",
    "format_validation",
    "validate",
]
