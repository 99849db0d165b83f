"""Training under `mpitrain train` with non-finite inputs injected on some ranks.

Usage: nan_burst_worker.py RANKS FIRST COUNT -- train CONFIG [--set ...]

RANKS is a comma-separated list of ranks.  On those ranks the first layer's
input of minibatches FIRST .. FIRST+COUNT-1 (counted in launches, so a roll
back does not repeat the burst) is overwritten with NaN after splicing, as a
bad feature block or a hardware fault would leave it.  ``install`` does the
same inside a test process.
"""

import os
import sys

import numpy as np

from mpitrain.train import step as step_module


def install(ranks, first: int, count: int, rank_of=lambda: 0):
    """Wrap the step's splice so that minibatches [first, first+count) are NaN."""
    original = step_module.splice_batch_
    launches = {"n": 0}

    def splice_then_poison(*args, **kwargs):
        result = original(*args, **kwargs)
        n = launches["n"]
        launches["n"] += 1
        if rank_of() in ranks and first <= n < first + count:
            kwargs["out"][...] = np.nan
        return result

    step_module.splice_batch_ = splice_then_poison
    return original


if __name__ == "__main__":
    ranks = {int(r) for r in sys.argv[1].split(",")}
    first, count = int(sys.argv[2]), int(sys.argv[3])
    assert sys.argv[4] == "--", sys.argv
    from mpitrain.cli import main
    # the launcher's rank (MPICH, Open MPI), known before MPI starts
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    install(ranks, first, count, rank_of=lambda: rank)
    raise SystemExit(main(sys.argv[5:]))
