"""One training step, the same for the trainer and for every benchmark.

A step is: pick the minibatch, splice its context windows into the first
layer's input, forward and backward with the summed cross-entropy, let the
strategy combine gradients, take the optimizer step, let the strategy average
models.  Running totals (cross-entropy, correct frames) stay on the device;
:meth:`TrainingStep.take_sums` reads them, once per log line.

Example::

    step = TrainingStep(net, optimizer, strategy, minibatch=256,
                        left_context=5, right_context=5)
    for n in range(steps):
        lr = step.run(n, schedule(n / steps), stream.next_batch)
    loss_sum, correct, frames = step.take_sums()
"""

from __future__ import annotations

from .. import backend
from ..data.splice import splice_batch_


class TrainingStep:
    """The per-minibatch work of training on one rank.

    ``next_batch()`` returns ``(chunk, idx)``: a chunk with ``feats``,
    ``labels``, ``utt_start`` and ``utt_end`` on the network's device, and the
    minibatch's frame indices into it.
    """

    def __init__(self, net, optimizer, strategy, *, minibatch: int, left_context: int,
                 right_context: int):
        self.net, self.optimizer, self.strategy = net, optimizer, strategy
        self.minibatch = int(minibatch)
        self.left, self.right = int(left_context), int(right_context)
        xp = net.xp
        # With fused kernels the minibatch is spliced straight into the first
        # layer's input buffer; otherwise into a contiguous one that it copies.
        inputs = net.first_input_view(self.minibatch) if backend.fused_kernels(xp) else None
        self.inputs = inputs if inputs is not None else \
            xp.empty((self.minibatch, net.input_dim), dtype=xp.float32)
        self.ctx = xp.empty((self.minibatch, net.context), dtype=xp.int64)
        self.sums = xp.zeros(2, dtype=xp.float64)   # summed cross-entropy, correct frames
        self.frames = 0

    def run(self, step: int, lr: float, next_batch) -> float:
        """Train 0-based step ``step`` with the schedule's rate ``lr``; returns the
        rate the strategy used (it may scale it)."""
        net, strategy = self.net, self.strategy
        lr = strategy.learning_rate(lr, step)
        if strategy.is_active(step):
            chunk, idx = next_batch()
            splice_batch_(chunk.feats, idx, chunk.utt_start, chunk.utt_end, self.left,
                          self.right, out=self.inputs, ctx=self.ctx)
            net.forward_backward(self.inputs, chunk.labels[idx], into=self.sums)
            strategy.reduce_gradients(net)
            self.optimizer.step(lr)
            self.frames += self.minibatch
        strategy.after_update(net, self.optimizer, step + 1)
        return lr

    def take_sums(self) -> tuple:
        """(summed cross-entropy, correct frames, frames) since the last call; resets them.

        The one read of the device per log line.
        """
        loss_sum, correct = backend.to_host(self.sums)
        frames = self.frames
        self.sums[...] = 0
        self.frames = 0
        return float(loss_sum), float(correct), frames
