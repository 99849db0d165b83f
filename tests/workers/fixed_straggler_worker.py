"""The ``parallel.straggler`` ranks sleep a fixed time after each step.

Usage: fixed_straggler_worker.py SECONDS [START_SECONDS] -- train CONFIG [--set ...]

Runs ``mpitrain train`` through the command-line entry point with a listed
rank's sleep made SECONDS a step, not ``slowdown - 1`` times the step's measured
compute.  A quickstart-size step computes for about a millisecond, so a 20x
slow rank led the others by a few tens of milliseconds a step: about what a
loaded machine's scheduler takes from a rank now and then, and a window could
name the wrong rank.  A fixed sleep keeps the lead whatever the load.
START_SECONDS makes rank 0's start record take that long (a slow file system
or a loaded node), while the other ranks go on to their first step.
"""

import sys
import time

from mpitrain.cli import main
from mpitrain.parallel.straggler import Straggler
from mpitrain.train.metrics import MetricsLog

seconds = float(sys.argv[1])
split = sys.argv.index("--")
start_seconds = float(sys.argv[2]) if split == 3 else 0.0
assert split in (2, 3), sys.argv
cli_args = sys.argv[split + 1:]
assert cli_args[:1] == ["train"], cli_args


def fixed_sleep(self):
    time.sleep(seconds)
    self.slept += seconds
    self.steps += 1
    return seconds


Straggler.step_finished = fixed_sleep
write = MetricsLog.write


def slow_start_record(self, kind, **fields):
    if kind == "start" and self.enabled:      # rank 0
        time.sleep(start_seconds)
    return write(self, kind, **fields)


MetricsLog.write = slow_start_record
sys.exit(main(cli_args))
