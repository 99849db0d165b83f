"""A stop signal reaches a rank that has ended its run while rank 0 still writes.

Usage: late_signal_worker.py SECONDS -- train|pretrain CONFIG [--set ...]

Runs ``mpitrain train`` (or ``pretrain``) through the command-line entry
point, with rank 0's writing of its result (final.h5, pretrain.h5) slowed by
SECONDS; every other rank sends itself SIGTERM SECONDS / 4 after its run
returned, as Slurm's signal reaches every task at once while rank 0 is still
writing.  Exits with the command's status.
"""

import os
import signal
import sys
import threading
import time

from mpitrain.cli import main
from mpitrain.train import pretrain, trainer

seconds = float(sys.argv[1])
assert sys.argv[2] == "--", sys.argv
cli_args = sys.argv[3:]
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def slowed(write):
    def slow_write(*args, **kwargs):
        time.sleep(seconds)
        return write(*args, **kwargs)
    return slow_write


def signalled_after(run):
    def run_then_signal(self):
        result = run(self)
        threading.Timer(seconds / 4, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return result
    return run_then_signal


if rank == 0:
    trainer.save_model = slowed(trainer.save_model)
    pretrain.save_rbm_stack = slowed(pretrain.save_rbm_stack)
else:
    trainer.Trainer.run = signalled_after(trainer.Trainer.run)
    pretrain.Pretrainer.run = signalled_after(pretrain.Pretrainer.run)
sys.exit(main(cli_args))
