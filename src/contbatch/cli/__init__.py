"""The `contbatch` command line (`contbatch.cli.main`).

A process that imports this package is a `contbatch` command's. Unless the command runs torch
(`TORCH_COMMANDS`) or the environment names a value, it sets OPENBLAS_NUM_THREADS to 1: numpy's
OpenBLAS otherwise starts a thread per CPU as numpy loads, and their start-up spin costs about as
much CPU as the import itself (0.085 of 0.185 CPU-s on 2 cores, more on larger hosts), while
these commands give numpy no BLAS work that threads would speed up (the metrics sort and sum;
the fits solve small least squares). Commands that run torch are left alone: torch's aarch64
builds compute small matrix products with their own OpenBLAS, which reads the same variable.
"""

import os
import sys

# the commands that may load torch (the engine): the BLAS threads of their process are torch's
TORCH_COMMANDS = frozenset({"serve", "run", "generate", "calibrate", "validate"})

if not TORCH_COMMANDS.intersection(sys.argv[1:2]):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
