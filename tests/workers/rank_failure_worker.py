"""One rank of a training run fails while the others go on, as a rank whose node
lost its copy of a shard does.

Usage: rank_failure_worker.py RANK AFTER_BATCHES -- train|pretrain CONFIG ...

Runs ``mpitrain train`` (or ``pretrain``) through the command-line entry
point, exactly as ``python -m mpitrain train`` does.  RANK raises an OSError
naming a shard while it reads its AFTER_BATCHES-th minibatch; that rank alone
fails, so it ends the job with MPI's abort.  Exits with the command's status.
"""

import os
import sys

from mpitrain.cli import main
from mpitrain.data.batcher import MinibatchStream

failing, after_batches = int(sys.argv[1]), int(sys.argv[2])
assert sys.argv[3] == "--", sys.argv
# (the launcher's rank: mpiexec of MPICH or Open MPI)
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
original_next_batch = MinibatchStream.next_batch
taken = {"batches": 0}


def next_batch_that_fails(self):
    taken["batches"] += 1
    if rank == failing and taken["batches"] == after_batches:
        raise OSError("train/shard-00003.h5: cannot read: Input/output error")
    return original_next_batch(self)


MinibatchStream.next_batch = next_batch_that_fails
sys.exit(main(sys.argv[4:]))
