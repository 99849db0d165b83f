"""One rank takes one step that lasts long (an evaluation, a busy core).

Usage: late_step_worker.py RANK STEP SECONDS STEP_SECONDS -- train CONFIG [--set ...]

Runs ``mpitrain train`` through the command-line entry point; the STEP-th
training step of rank RANK sleeps SECONDS first, and every step of every rank
sleeps STEP_SECONDS (steady steps on a loaded machine).  SECONDS written ``Nx``
is N times the median time between that rank's earlier steps, as measured in
this run: the late step lasts about N steps of the others whatever the load (on
a busy machine every step is slower, and a fixed late step let the others take
too few steps to tell stopping at the budget from stepping on).  Asynchronous
ADPSGD must still end near its step budget when rank 0 is the late one: only
rank 0 hears every rank's reports, between its own steps.
"""

import os
import sys
import time

from mpitrain.cli import main
from mpitrain.train.step import TrainingStep

split = sys.argv.index("--")
assert split == 5, sys.argv
late_rank, late_step = int(sys.argv[1]), int(sys.argv[2])
late, step_seconds = sys.argv[3], float(sys.argv[4])
cli_args = sys.argv[split + 1:]
assert cli_args[:1] == ["train"], cli_args
assert late_step >= 3 or not late.endswith("x"), "Nx needs two earlier steps to measure"

original_step = TrainingStep.run
started = []          # when each step of this rank began


def late_seconds() -> float:
    if not late.endswith("x"):
        return float(late)
    gaps = sorted(b - a for a, b in zip(started, started[1:]))
    return float(late[:-1]) * gaps[len(gaps) // 2]


def sleepy_step(self, step, lr, next_batch):
    started.append(time.perf_counter())
    if len(started) == late_step and rank == late_rank:
        time.sleep(late_seconds())
    time.sleep(step_seconds)
    return original_step(self, step, lr, next_batch)


TrainingStep.run = sleepy_step
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
sys.exit(main(cli_args))
