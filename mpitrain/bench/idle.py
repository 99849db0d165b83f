"""Idle ranks: sleep while other ranks are measured, wake when rank 0 says so.

A benchmark that times fewer ranks than it launched (one rank against two in
``scaling``, groups of 1, 2, 4 ranks in ``mpitrain bench``) must keep the
others off the cores.  An MPI barrier or blocking receive spins on a core,
so an idle rank instead polls a non-blocking receive with sleeps in between
(:func:`wait_idle`) until rank 0 sends it a token (:func:`release_idle`).

Example::

    if comm.rank == 0:
        measure_alone()
        release_idle(comm, range(1, comm.size))
    else:
        wait_idle(comm)
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

#: Message tag of the wake-up token; no benchmark sends anything else with it.
IDLE_TAG = 7101
#: Seconds between polls: the longest an idle rank oversleeps its release.
POLL_SECONDS = 0.002


def wait_idle(comm, *, source: int = 0, poll_seconds: float = POLL_SECONDS) -> None:
    """Block until ``source`` sends the token, without keeping a core busy."""
    token = np.zeros(1, dtype=np.int32)
    request = comm.irecv(token, source=source, tag=IDLE_TAG)
    while not request.test():
        comm.idle(poll_seconds)


def release_idle(comm, ranks: Iterable[int]) -> None:
    """Wake each rank of ``ranks`` waiting in :func:`wait_idle`; returns once sent."""
    token = np.ones(1, dtype=np.int32)
    comm.waitall([comm.isend(token, dest=r, tag=IDLE_TAG) for r in ranks])
