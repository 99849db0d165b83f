"""`mpitrain train --set device=gpu --set device_transport=cuda-aware-mpi` through the
command line on the CuPy stand-in, where this MPI library claims no CUDA support:
the forced route cannot be used on any rank.

Usage: forced_route_worker.py CORPUS RUN_DIR
"""

import os
import sys

from mpitrain import cli
from mpitrain.testing import standin_cupy

corpus, run_dir = sys.argv[1:3]
os.environ.pop("MPITRAIN_CUDA_AWARE_MPI", None)     # the library is asked, not overridden
config = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "configs", "quickstart.yaml")
with standin_cupy.installed():
    code = cli.main(["train", config, "--run-dir", run_dir,
                     "--set", f"data.train={corpus}/train", "--set", f"data.dev={corpus}/dev",
                     "--set", "data.chunk_frames=20000", "--set", "device=gpu",
                     "--set", "device_transport=cuda-aware-mpi"])
sys.exit(code)
