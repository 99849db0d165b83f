"""Helpers for mpitrain's own tests (launching MPI workers, skips).

Importing this package imports neither pytest nor mpi4py.

Example::

    from mpitrain.testing.mpirun import run_mpi
    run_mpi(2, ["tests/workers/comm_worker.py"])
"""

from .gpu import gpu_required
from .mpirun import SKIP_EXIT_CODE, MpiTimeoutError, find_mpiexec, run_mpi, skip_worker

__all__ = ["SKIP_EXIT_CODE", "MpiTimeoutError", "find_mpiexec", "gpu_required", "run_mpi",
           "skip_worker"]
