"""Learning-rate schedules, as functions of training progress in [0, 1]."""

from __future__ import annotations

import math


class ExponentialSchedule:
    """Geometric decay from ``initial`` to ``final`` over the run (Kaldi's rule).

    lr(p) = initial * (final / initial) ** p, where p is the fraction of the
    planned training data seen so far.

    Example::

        sched = ExponentialSchedule(0.002, 0.0002)
        sched(0.0), sched(1.0)        # (0.002, 0.0002)
    """

    def __init__(self, initial: float, final: float):
        if initial <= 0 or final <= 0:
            raise ValueError(f"learning rates must be > 0, got {initial}, {final}")
        self.initial, self.final = float(initial), float(final)
        self._log_ratio = math.log(self.final / self.initial)

    def __call__(self, progress: float) -> float:
        progress = min(max(progress, 0.0), 1.0)
        return self.initial * math.exp(progress * self._log_ratio)
