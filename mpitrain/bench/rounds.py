"""Interleaved timed rounds of several contenders on every rank, one launch.

On a shared machine the load from other processes changes from second to
second.  :func:`time_contenders` therefore runs every contender for a few
steps per round, many rounds, the order rotating each round, so that the same
load hits all of them; each call starts from a barrier, a round's time is its
slowest rank's, and the share of it spent inside the communicator is kept.
A contender may run on rank 0 alone while the other ranks sleep
(:mod:`mpitrain.bench.idle`).  Used by ``scaling`` and ``ddp_compare``.

Example::

    times = time_contenders(comm, {"alone": a.run, "averaging": b.run}, rounds=15,
                            steps=16, skip=8, root_only=["alone"])
    times["averaging"]["seconds"]      # one per round, the slowest rank's
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from .idle import release_idle, wait_idle


def time_contenders(comm, contenders: dict, *, rounds: int, steps: int, skip: int,
                    root_only: Sequence[str] = ()) -> dict:
    """Interleaved timing: ``{name: {"seconds": [...], "comm": [...], "ranks": n}}``.

    ``contenders`` maps a name to a callable ``run(steps)``.  Names in
    ``root_only`` run on rank 0 alone while the other ranks sleep.  Each
    contender first runs ``skip`` untimed steps.  A round's seconds are the
    slowest rank's; ``comm`` is the mean over ranks of the fraction of the round
    spent inside ``comm``.  Identical on every rank.

    Example::

        times = time_contenders(comm, {"local": steps.run}, rounds=3, steps=8, skip=2)
    """
    names = list(contenders)

    def one(name, count):
        alone = name in root_only
        comm.barrier()
        before = comm.comm_time
        start = time.perf_counter()
        if not alone or comm.rank == 0:
            contenders[name](count)
        elapsed = time.perf_counter() - start
        spent = comm.comm_time - before
        if alone and comm.size > 1:
            if comm.rank == 0:
                release_idle(comm, range(1, comm.size))
            else:
                wait_idle(comm)
                elapsed = spent = 0.0
        return elapsed, spent

    for name in names:
        one(name, skip)
    seconds = np.zeros((len(names), rounds))
    fractions = np.zeros((len(names), rounds))
    for r in range(rounds):
        for k in range(len(names)):
            i = (r + k) % len(names)
            elapsed, spent = one(names[i], steps)
            seconds[i, r] = elapsed
            fractions[i, r] = spent / elapsed if elapsed > 0 else 0.0
    comm.allreduce_(seconds.reshape(-1), op="max")
    comm.allreduce_(fractions.reshape(-1), op="sum")
    result = {}
    for i, name in enumerate(names):
        ranks = 1 if name in root_only else comm.size
        result[name] = {"seconds": seconds[i].tolist(),
                        "comm": (fractions[i] / ranks).tolist(), "ranks": ranks}
    return result
