"""Model averaging every K minibatches (Su & Chen, "Scaling deep learning on
multiple in-memory processors" / MPI Allreduce model averaging on many GPUs,
with NG-SGD as in Povey, Zhang & Khudanpur).

The rule, for N ranks with parameters w_i, every K local steps::

    w_i <- (1/N) sum_j w_j          one in-place Allreduce of the flat buffer

Each rank trains on its own data between averages; optimizer state stays
local unless ``average_momentum`` (then the momentum buffers are averaged
too), and the optimizer hears :meth:`~mpitrain.optim.base.Optimizer.after_average`
(NG-SGD then starts fresh Fisher estimates, as each Kaldi job does).  With
K = 1 and plain SGD this equals synchronous SGD from a common start.

Symbols in the code: K is ``every_steps``, w_i is ``net.params``, N is
``comm.size``.
"""

from __future__ import annotations

from .base import Strategy, every_steps_from


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: model_averaging``."""
    return ModelAveraging(comm, every_steps=every_steps_from(cfg),
                          average_momentum=cfg.parallel.average_momentum)


class ModelAveraging(Strategy):
    """Example::

        strategy = ModelAveraging(comm, every_steps=8)
    """

    name = "model_averaging"

    def __init__(self, comm, *, every_steps: int = 8, average_momentum: bool = False):
        super().__init__(comm)
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = int(every_steps)
        self.average_momentum = average_momentum
        self.num_averages = 0
        self.sync_period = self.every_steps

    def after_update(self, net, optimizer, step: int) -> None:
        if step % self.every_steps == 0:
            self.average(net, optimizer)

    def average(self, net, optimizer) -> None:
        if self.comm.size == 1:
            return
        self.comm.allreduce_(net.params, op="mean")
        momentum = optimizer.momentum_buffer()
        if self.average_momentum and momentum is not None:
            self.comm.allreduce_(momentum, op="mean")
        optimizer.after_average()
        self.num_averages += 1

    def finalize(self, net, optimizer, step: int = 0) -> None:
        # the last block may be shorter than K: average once more so all agree
        if step % self.every_steps:
            self.average(net, optimizer)
