"""The `contbatch` command line (`contbatch.cli.main`).

A process that imports this package is a `contbatch` command's: it sets OPENBLAS_NUM_THREADS to
1 unless the environment names a value. numpy's OpenBLAS otherwise starts a thread per CPU as
numpy loads, and their start-up spin costs about as much CPU as the import itself (0.085 of
0.185 CPU-s on 2 cores, more on larger hosts), while no command gives numpy BLAS work that
threads would speed up (the metrics sort and sum; the fits solve small least squares; the
engine computes with torch's own libraries, which this setting does not touch).
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
