"""A stop signal reaches a rank whose run is complete while it waits in MPI's
finalize for a slower rank.

Usage: finalize_signal_worker.py SIGNAL SECONDS -- train|pretrain CONFIG [--set ...]

Runs ``mpitrain train`` (or ``pretrain``) through the command-line entry
point; rank 0 lingers SECONDS after its run (at the interpreter's exit, before
MPI's finalize), and every other rank has SIGNAL sent to it SECONDS / 3 after
its own command returned, by a process of its own: by then it is past Python
and inside MPI's finalize, waiting for rank 0.  Exits with the command's status.
"""

import atexit
import os
import subprocess
import sys
import time

from mpitrain.cli import main
from mpitrain.process import command_line_owns_process

signame, seconds = sys.argv[1], float(sys.argv[2])
assert sys.argv[3] == "--", sys.argv
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
if rank == 0:
    atexit.register(time.sleep, seconds)
command_line_owns_process()        # (as `python -m mpitrain` is)
status = main(sys.argv[4:])
if rank != 0:
    # (a separate process: no thread of this one runs once Python has finalized)
    subprocess.Popen(["sh", "-c", f"sleep {seconds / 3}; kill -{signame[3:]} {os.getpid()}"])
sys.exit(status)
