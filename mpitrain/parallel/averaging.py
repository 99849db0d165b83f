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
    """Synchronous SGD: average the gradient buffer every step.

    With ``overlap`` the reduction starts during the backward pass: whenever
    at least ``bucket_bytes`` of finished gradients (the last layers finish
    first) are pending, a non-blocking Allreduce of them is started; the step
    waits for all of them before the update.  It pays where the transport
    progresses on its own (NCCL, or MPI with an asynchronous progress thread);
    with MPICH's default host progress the reductions mostly run at the wait.

    Example::

        strategy = GradientAllreduce(comm, overlap=True)
    """

    name = "allreduce"
    reduces_gradients = True

    def __init__(self, comm, *, overlap: bool = False, bucket_bytes: int = 25 << 20):
        super().__init__(comm)
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.overlap = bool(overlap)
        self.bucket_bytes = int(bucket_bytes)
        self._pending = []
        self._end = None

    def setup(self, net, optimizer) -> None:
        super().setup(net, optimizer)
        self.bind(net)

    def bind(self, net) -> None:
        if self.overlap and self.comm.size > 1:
            net.grad_ready_hook = lambda offset: self._grads_ready(net, offset)

    def _grads_ready(self, net, offset: int) -> None:
        end = net.num_params if self._end is None else self._end
        if (end - offset) * net.grads.itemsize >= self.bucket_bytes or offset == 0:
            self._pending.append(self.comm.iallreduce_(net.grads[offset:end], op="mean"))
            self._end = offset

    def reduce_gradients(self, net) -> None:
        if self.comm.size == 1:
            return
        if not self.overlap:
            self.comm.allreduce_(net.grads, op="mean")
            return
        self.comm.waitall(self._pending)
        self._pending, self._end = [], None
