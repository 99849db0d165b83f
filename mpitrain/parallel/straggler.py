"""Slow ranks on purpose (``parallel.straggler``), to see how a method copes.

A listed rank sleeps after each of its training steps so that the step takes
``slowdown`` times its measured compute time, plus a seeded random extra
fraction of up to ``jitter``::

    sleep = compute x (slowdown - 1 + jitter x u),   u ~ U[0, 1) from (seed, rank)

(a benchmark's repeat k > 0 of a run: u from (seed, rank, k), a draw of its own).

``compute`` is the step's wall time less the time spent inside communicator
calls (a gradient allreduce waits for the other ranks; that is not compute).
On a GPU the device is synchronised first, so its queued work counts.

Example::

    straggler = build_straggler([1], comm, slowdown=2.0, jitter=0.0, seed=1)
    straggler.step_started()        # None on every rank but 1
    ...                             # the step
    straggler.step_finished()       # sleeps as long again
"""

from __future__ import annotations

import time

import numpy as np

# Kept apart from the other seeded streams (initialisation, shuffling, rings).
_JITTER_STREAM = 0x5105


class StragglerRankError(ValueError):
    """A listed rank outside the job.  Every rank sees the same settings and job
    size, so all raise it together (``agreed``): one line, no abort."""

    agreed = True


def build_straggler(ranks, comm, *, slowdown: float = 2.0, jitter: float = 0.0,
                    seed: int = 0, repeat: int = 0):
    """This rank's :class:`Straggler`, or None when ``comm.rank`` is not listed.
    ``repeat``: a benchmark's repeat of a run (its own jitter draw; 0: a single run's).

    Raises :class:`StragglerRankError` naming ``parallel.straggler.ranks`` when a
    listed rank is not in the job.

    Example::

        build_straggler([], comm)    # None: nobody is slowed
    """
    outside = sorted({int(r) for r in ranks if int(r) >= comm.size})
    if outside:
        raise StragglerRankError(
            f"parallel.straggler.ranks: rank {outside[0]} is not in this job of "
            f"{comm.size} rank(s) (ranks 0..{comm.size - 1})")
    if comm.rank not in {int(r) for r in ranks}:
        return None
    return Straggler(comm, slowdown=slowdown, jitter=jitter, seed=seed, repeat=repeat)


class Straggler:
    """Makes this rank's steps ``slowdown`` (+ up to ``jitter``) times as long.

    Example::

        slow = Straggler(comm, slowdown=2.0, jitter=0.5, seed=1)   # 2x to 2.5x
    """

    def __init__(self, comm, *, slowdown: float = 2.0, jitter: float = 0.0, seed: int = 0,
                 repeat: int = 0):
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1, got {slowdown}")
        if not jitter >= 0.0:
            raise ValueError(f"jitter must be >= 0, got {jitter}")
        self.comm = comm
        self.slowdown, self.jitter = float(slowdown), float(jitter)
        # (a repeat's draw is seeded apart, so each of a benchmark's repeats measures
        # another run, and the same command gives the same repeats)
        self._rng = np.random.default_rng([int(seed), _JITTER_STREAM, int(comm.rank)] +
                                          ([int(repeat)] if repeat else []))
        self._started = self._comm_at_start = 0.0
        self.slept = 0.0            # seconds slept so far
        self.steps = 0

    def step_started(self) -> None:
        self._started = time.perf_counter()
        self._comm_at_start = self.comm.comm_time

    def step_finished(self) -> float:
        """Sleep for this step; returns the seconds slept."""
        from ..backend import synchronize
        synchronize()                       # queued device work is compute too
        wall = time.perf_counter() - self._started
        compute = max(wall - (self.comm.comm_time - self._comm_at_start), 0.0)
        factor = self.slowdown - 1.0
        if self.jitter:
            factor += self.jitter * float(self._rng.random())
        pause = compute * factor
        if pause > 0:
            time.sleep(pause)
        self.slept += pause
        self.steps += 1
        return pause
