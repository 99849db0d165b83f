"""A shard goes bad under one rank in the middle of training.

Usage: train_truncate_worker.py FAILING_RANK AFTER_BATCHES -- train CONFIG [--set ...]

Runs ``mpitrain train`` through the command-line entry point, exactly as
``python -m mpitrain train`` does.  On FAILING_RANK, after AFTER_BATCHES
minibatches, the shard files that rank reads are truncated to half their
size (as a full disk or a dying file server would leave them), so one of its
next chunk reads fails for real while the other ranks carry on into their
next collective.  The job must end quickly with the reading error, not hang.
"""

import os
import sys

from mpitrain.cli import main
from mpitrain.data.batcher import MinibatchStream

failing_rank, after_batches = int(sys.argv[1]), int(sys.argv[2])
assert sys.argv[3] == "--", sys.argv
cli_args = sys.argv[4:]
assert cli_args[:1] == ["train"], cli_args

original_next_batch = MinibatchStream.next_batch
taken = {"batches": 0}


def next_batch_then_truncate(self):
    if self.rank == failing_rank:
        taken["batches"] += 1
        if taken["batches"] == after_batches + 1:
            for index in sorted({c.shard_index for c in self.chunks}):
                path = self.manifest.shard_path(index)
                os.truncate(path, os.path.getsize(path) // 2)
            print(f"rank {self.rank}: truncated its shards after {after_batches} minibatches",
                  flush=True)
    return original_next_batch(self)


MinibatchStream.next_batch = next_batch_then_truncate
raise SystemExit(main(cli_args))
