"""`mpitrain train` through the command line, with rank 1 alone interrupted while
the ranks start: before MPI (reading the configuration) or after it (agreeing on
the settings), when no run has begun that would end the job for it; or
`mpitrain synth` with rank 0 interrupted while it writes and the others wait.

Usage: start_interrupt_worker.py config|settings|synth CORPUS OUT

Without the job ending on every rank, the others would wait for the
interrupted rank in MPI forever.
"""

import os
import sys

from mpitrain import cli, config, launch
from mpitrain.data import synthetic

where, corpus, run_dir = sys.argv[1:4]
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def interrupted_on_rank(real, interrupted=1):
    def call(*args, **kwargs):
        if rank == interrupted:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    return call


if where == "synth":
    synthetic.synthesize = interrupted_on_rank(synthetic.synthesize, 0)
    sys.exit(cli.main(["synth", run_dir, "--hours", "0.01"]))
if where == "config":
    config.load_config = interrupted_on_rank(config.load_config)
else:
    launch._settings_problem = interrupted_on_rank(launch._settings_problem)
quickstart = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "configs",
                          "quickstart.yaml")
sys.exit(cli.main(["train", quickstart, "--run-dir", run_dir,
                   "--set", f"data.train={corpus}/train", "--set", f"data.dev={corpus}/dev"]))
