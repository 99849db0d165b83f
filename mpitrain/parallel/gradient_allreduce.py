"""Synchronous SGD by gradient averaging: the baseline the averaging methods are
measured against (one Allreduce of the gradient buffer every step).

The rule, for N ranks with gradients g_i of the same parameters w::

    g <- (1/N) sum_j g_j;   w <- w - lr g          every step, on every rank

Because the loss is summed over a minibatch, N ranks at rate N lr take the
step one rank would take on a minibatch N times larger at rate lr.

Symbols in the code: g_i is ``net.grads``, N is ``comm.size``.
"""

from __future__ import annotations

from .base import Strategy


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: allreduce``."""
    # (any bucket_mb > 0 is allowed: one under a byte reduces each layer as it
    # finishes, as one byte does; rounding it down to 0 bytes refused the setting)
    return GradientAllreduce(comm, overlap=cfg.parallel.overlap,
                             bucket_bytes=max(1, int(cfg.parallel.bucket_mb * (1 << 20))))


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
