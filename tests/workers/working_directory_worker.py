"""A command whose ranks start in directories of their own, as with mpiexec's
-wdir per rank or a batch script that changes directory on one node.

Usage: working_directory_worker.py DIR_OF_RANK_0 DIR_OF_THE_OTHERS -- COMMAND ARGS...

Runs ``mpitrain COMMAND`` through the command-line entry point, exactly as
``python -m mpitrain`` does, after changing to the rank's directory.  Exits
with the command's status.
"""

import os
import sys

from mpitrain.cli import main

assert sys.argv[3] == "--", sys.argv
# (the launcher's rank: mpiexec of MPICH or Open MPI)
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
os.chdir(sys.argv[1] if rank == 0 else sys.argv[2])
sys.exit(main(sys.argv[4:]))
