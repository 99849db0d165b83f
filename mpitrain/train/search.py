"""Trials of ``optimizer.schedule: search``: train a few minibatches at a trial rate,
score them, and put everything back.

A trial starts from this rank's current weights, optimizer state and reader
position, trains ``steps`` minibatches of the coming data at the given rate
on this rank alone (no averaging or gradient exchange: a trial is short),
scores each minibatch's cross-entropy before its update, and then restores
the weights, the optimizer (momentum, natural-gradient and adapt statistics,
counters) and the reader, so the real run continues as if nothing happened.
The scores and frames are summed over all ranks with one allreduce and the
objective is their ratio (cross-entropy per frame of all ranks), so every rank sees
the same objective and :class:`~mpitrain.optim.search.SearchSchedule` picks
the same rate everywhere.

Example::

    trials = RateTrials(net, optimizer, strategy, stream, comm, minibatch=256,
                        left_context=5, right_context=5)
    objective, frames = trials.run(0.004, steps=42, step=step)
"""

from __future__ import annotations

import math

import numpy as np

from .resume import copied_state
from .step import TrainingStep


class _Alone:
    """The strategy of a trial step: this rank trains alone, nothing is exchanged;
    the L2 term and the max-change are scaled as the run's strategy scales them at
    the trial's steps."""

    reduces_gradients = False
    straggler = None

    def __init__(self):
        self.l2 = 1.0
        self.max_change = 1.0

    def learning_rate(self, lr: float, step: int = 0) -> float:
        return lr

    def l2_factor(self, step: int = 0) -> float:
        return self.l2

    def max_change_factor(self, step: int = 0) -> float:
        return self.max_change

    def is_active(self, step: int) -> bool:
        return True

    def reduce_gradients(self, net) -> None:
        pass

    def after_update(self, net, optimizer, step: int) -> None:
        pass


class RateTrials:
    """Runs trials for the search schedule (see the module docstring)."""

    def __init__(self, net, optimizer, strategy, stream, comm, *, minibatch: int,
                 left_context: int, right_context: int):
        self.net, self.optimizer, self.strategy = net, optimizer, strategy
        self.stream, self.comm = stream, comm
        self._alone = _Alone()
        self.step = TrainingStep(net, optimizer, self._alone, minibatch=minibatch,
                                 left_context=left_context, right_context=right_context)

    def run(self, rate: float, *, steps: int, step: int) -> tuple:
        """(cross-entropy per frame over all ranks' trial minibatches, their frames);
        the objective is inf if any rank's trial skipped a non-finite step."""
        net, optimizer, stream = self.net, self.optimizer, self.stream
        params = net.params.copy()
        opt_state = copied_state(optimizer.state_dict())
        reader = dict(stream.state_dict())
        # the rate real steps would take here (kaldi scales it by its number of jobs)
        lr = self.strategy.learning_rate(rate, step)
        # and the L2 term as scaled there (kaldi: by 1/its number of jobs)
        self._alone.l2 = self.strategy.l2_factor(step)
        self._alone.max_change = self.strategy.max_change_factor(step)
        self.step.take_sums()                     # start from empty sums
        # the run's strategy may reduce gradients during backward (allreduce with
        # overlap): a trial exchanges nothing, so its backward must not start any
        hook, net.grad_ready_hook = net.grad_ready_hook, None
        try:
            for n in range(steps):
                self.step.run(step + n, lr, stream.next_batch)
            loss, _, frames, skipped = self.step.take_sums()
        finally:
            net.grad_ready_hook = hook
            net.params[...] = params
            optimizer.load_state_dict(opt_state)
            stream.load_state_dict(reader)
        sums = np.array([loss, frames, skipped], dtype=np.float64)
        self.comm.allreduce_(sums, op="sum")
        frames = int(sums[1])
        objective = sums[0] / sums[1] if sums[1] > 0 and sums[2] == 0 else math.inf
        return (objective if math.isfinite(objective) else math.inf), frames
