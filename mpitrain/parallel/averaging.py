"""Model averaging every K minibatches (Su & Chen) and synchronous allreduce.

``ModelAveraging``: each rank trains on its own data; every K steps (or every
S frames per rank) the flat parameter buffer is averaged in place with one
Allreduce.  Optimizer state stays local unless ``average_momentum``.
With K = 1 and plain SGD this equals synchronous SGD from a common start.

``GradientAllreduce``: the gradient buffer is averaged every step before the
optimizer step (the synchronous baseline).
"""

from __future__ import annotations

from .base import Strategy


class ModelAveraging(Strategy):
    """Example::

        strategy = ModelAveraging(comm, every_steps=8)
    """

    name = "model_averaging"

    def __init__(self, comm, *, every_steps: int = 8, average_momentum: bool = False,
                 reset_preconditioners: bool = True):
        super().__init__(comm)
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = int(every_steps)
        self.average_momentum = average_momentum
        self.reset_preconditioners = reset_preconditioners
        self.num_averages = 0
        self.sync_period = self.every_steps

    def after_update(self, net, optimizer, step: int) -> None:
        if step % self.every_steps == 0:
            self.average(net, optimizer)

    def average(self, net, optimizer) -> None:
        if self.comm.size == 1:
            return
        self.comm.allreduce_(net.params, op="mean")
        if self.average_momentum and getattr(optimizer, "delta", None) is not None:
            self.comm.allreduce_(optimizer.delta, op="mean")
        if self.reset_preconditioners and hasattr(optimizer, "reset_preconditioners"):
            optimizer.reset_preconditioners()
        self.num_averages += 1

    def finalize(self, net, optimizer, step: int = 0) -> None:
        # the last block may be shorter than K: average once more so all agree
        if step % self.every_steps:
            self.average(net, optimizer)


class GradientAllreduce(Strategy):
    """Example::

        strategy = GradientAllreduce(comm)     # averages net.grads every step
    """

    name = "allreduce"

    def reduce_gradients(self, net) -> None:
        if self.comm.size > 1:
            self.comm.allreduce_(net.grads, op="mean")
