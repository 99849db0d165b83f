"""``training.checkpoint_minutes``: checkpoints by the clock, besides those every
``training.checkpoint_interval`` steps.

A job can lose its node without warning (preemption by a kill, a node
failure); it then loses what it trained since its last checkpoint.  People
size that loss in minutes, while a step's time depends on the model, the
ranks and the machine: a checkpoint at most every M minutes bounds it where
a step count cannot.

Rank 0's clock decides (the ranks' clocks differ), and the lock-step loops
(train, pretrain) tell the other ranks inside an exchange they hold anyway:
the sums of the log line, or the stop poll between log lines far apart
(train/stop.py, about every 2 s).  Every rank then writes the checkpoint at
the first step from there where one may be written, as for a checkpoint
every N steps.  The loops with one decider (the parameter server's server 0,
asynchronous ADPSGD's rank 0) ask the clock directly.  The clock starts
again at every checkpoint written, by steps or by the clock.

Example::

    clock = CheckpointClock(comm, minutes=30)
    sums[-1] = clock.flag()              # rank 0's "due" in the log line's sums
    comm.allreduce_(sums)
    clock.hear(sums[-1])
    if clock.agreed and strategy.can_checkpoint(step):
        save_checkpoint()
        clock.written()
"""

from __future__ import annotations


class CheckpointClock:
    """Whether a checkpoint is due by rank 0's clock (``minutes`` <= 0: never)."""

    def __init__(self, comm, minutes: float):
        self.comm = comm
        self.seconds = max(float(minutes), 0.0) * 60.0
        self._heard = False          # every rank heard rank 0 say a checkpoint is due
        self._since = comm.wtime()

    @property
    def agreed(self) -> bool:
        """Every rank knows a checkpoint is due (one rank alone: by its own clock)."""
        return self._heard or (self.comm.size == 1 and self.due())

    def due(self) -> bool:
        """By this rank's own clock (the decider's question)."""
        return self.seconds > 0 and self.comm.wtime() - self._since >= self.seconds

    def flag(self) -> float:
        """1.0 on rank 0 when a checkpoint is due, else 0.0: its part of a sum that
        tells every rank."""
        return float(self.comm.rank == 0 and self.due())

    def hear(self, flag) -> None:
        """What an exchange said of rank 0's flag."""
        if flag:
            self._heard = True

    def written(self) -> None:
        """A checkpoint was written (or given up on): the clock starts again."""
        self._heard = False
        self._since = self.comm.wtime()
