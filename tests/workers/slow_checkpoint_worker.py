"""Rank 0 takes a while to write each checkpoint (a slow shared file system).

Usage: slow_checkpoint_worker.py SECONDS -- train CONFIG [--set ...]

Runs ``mpitrain train`` through the command-line entry point, with rank 0's
checkpoint writes slowed by SECONDS each.  Asynchronous ADPSGD must still end
near its step budget, with its ranks taking comparable step counts: the other
ranks wait at the checkpoint instead of stepping on while rank 0 writes.
"""

import sys
import time

from mpitrain.cli import main
from mpitrain.train.trainer import Trainer

seconds = float(sys.argv[1])
assert sys.argv[2] == "--", sys.argv
cli_args = sys.argv[3:]
assert cli_args[:1] == ["train"], cli_args

original_write = Trainer._write_checkpoint


def slow_write(self, states):
    time.sleep(seconds)
    return original_write(self, states)


Trainer._write_checkpoint = slow_write
sys.exit(main(cli_args))
