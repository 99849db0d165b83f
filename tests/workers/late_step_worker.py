"""One rank takes one step that lasts long (an evaluation, a busy core).

Usage: late_step_worker.py RANK STEP SECONDS STEP_SECONDS -- train CONFIG [--set ...]

Runs ``mpitrain train`` through the command-line entry point; the STEP-th
training step of rank RANK sleeps SECONDS first, and every step of every rank
sleeps STEP_SECONDS (steady steps on a loaded machine).  Asynchronous ADPSGD
must still end near its step budget when rank 0 is the late one: only rank 0
hears every rank's reports, between its own steps.
"""

import os
import sys
import time

from mpitrain.cli import main
from mpitrain.train.step import TrainingStep

split = sys.argv.index("--")
assert split == 5, sys.argv
late_rank, late_step = int(sys.argv[1]), int(sys.argv[2])
seconds, step_seconds = float(sys.argv[3]), float(sys.argv[4])
cli_args = sys.argv[split + 1:]
assert cli_args[:1] == ["train"], cli_args

original_step = TrainingStep.run
taken = []


def sleepy_step(self, step, lr, next_batch):
    taken.append(1)
    if len(taken) == late_step and rank == late_rank:
        time.sleep(seconds)
    time.sleep(step_seconds)
    return original_step(self, step, lr, next_batch)


TrainingStep.run = sleepy_step
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
sys.exit(main(cli_args))
