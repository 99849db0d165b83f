"""`mpitrain train` through the command line, with one rank interrupted or failing
with a bug at its third step while the others go on into the next collective.

Usage: cli_failure_worker.py interrupt|bug CORPUS RUN_DIR

Without the job ending on every rank the healthy ranks would wait forever.
"""

import os
import sys

from mpitrain import cli
from mpitrain.train import step as step_module

mode, corpus, run_dir = sys.argv[1:4]
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
real_run = step_module.TrainingStep.run


def failing_run(self, step, *args, **kwargs):
    if rank == 1 and step == 2:
        if mode == "interrupt":
            raise KeyboardInterrupt
        raise KeyError("deliberate bug on rank 1")
    return real_run(self, step, *args, **kwargs)


step_module.TrainingStep.run = failing_run
config = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "configs", "quickstart.yaml")
sys.exit(cli.main(["train", config, "--run-dir", run_dir,
                   "--set", f"data.train={corpus}/train", "--set", f"data.dev={corpus}/dev",
                   "--set", "data.chunk_frames=20000", "--set", "parallel.method=adpsgd"]))
