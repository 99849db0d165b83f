"""The ``parallel.straggler`` ranks sleep a fixed time after each step.

Usage: fixed_straggler_worker.py SECONDS -- train CONFIG [--set ...]

Runs ``mpitrain train`` through the command-line entry point with a listed
rank's sleep made SECONDS a step, not ``slowdown - 1`` times the step's measured
compute.  A quickstart-size step computes for about a millisecond, so a 20x
slow rank led the others by a few tens of milliseconds a step: about what a
loaded machine's scheduler takes from a rank now and then, and a window could
name the wrong rank.  A fixed sleep keeps the lead whatever the load.
"""

import sys
import time

from mpitrain.cli import main
from mpitrain.parallel.straggler import Straggler

seconds = float(sys.argv[1])
assert sys.argv[2] == "--", sys.argv
cli_args = sys.argv[3:]
assert cli_args[:1] == ["train"], cli_args


def fixed_sleep(self):
    time.sleep(seconds)
    self.slept += seconds
    self.steps += 1
    return seconds


Straggler.step_finished = fixed_sleep
sys.exit(main(cli_args))
