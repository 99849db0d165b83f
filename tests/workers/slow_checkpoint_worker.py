"""Rank 0 takes a while to write each checkpoint (a slow shared file system).

Usage: slow_checkpoint_worker.py SECONDS [STEP_SECONDS] -- train CONFIG [--set ...]

Runs ``mpitrain train`` through the command-line entry point, with rank 0's
checkpoint writes slowed by SECONDS each, and every rank's steps by STEP_SECONDS
(default 0).  SECONDS written ``Nx`` is N times the median time between rank
0's steps so far, as measured in this run: a write lasts about N steps of the
others however busy the machine (a fixed time is fewer steps when every step is
slower, and starving rank 0 was then harder to tell).  Asynchronous ADPSGD must still end near its step budget, with its
ranks taking comparable step counts: the other ranks wait at the checkpoint
instead of stepping on while rank 0 writes.  A step that sleeps is steady on a
loaded machine: a millisecond of compute, the others took tens of steps while
the scheduler held rank 0 back, and passed the budget as if it wrote a file.
"""

import sys
import time

from mpitrain.cli import main
from mpitrain.train.step import TrainingStep
from mpitrain.train.trainer import Trainer

split = sys.argv.index("--")
assert split in (2, 3), sys.argv
seconds = sys.argv[1]
step_seconds = float(sys.argv[2]) if split == 3 else 0.0
cli_args = sys.argv[split + 1:]
assert cli_args[:1] == ["train"], cli_args

original_write = Trainer._write_checkpoint
original_step = TrainingStep.run


started = []          # when each step of this rank began


def write_seconds() -> float:
    if not seconds.endswith("x"):
        return float(seconds)
    gaps = sorted(b - a for a, b in zip(started, started[1:]))
    return float(seconds[:-1]) * gaps[len(gaps) // 2] if gaps else 0.0


def slow_write(self, states):
    time.sleep(write_seconds())
    return original_write(self, states)


def slow_step(self, step, lr, next_batch):
    started.append(time.perf_counter())
    time.sleep(step_seconds)
    return original_step(self, step, lr, next_batch)


Trainer._write_checkpoint = slow_write
TrainingStep.run = slow_step
sys.exit(main(cli_args))
