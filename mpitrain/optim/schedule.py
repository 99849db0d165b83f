"""Learning-rate schedules: the rate of each 0-based step, and the state that continues it.

Rules (r0 = ``optimizer.initial_learning_rate``, n the step, N the planned steps)::

    exponential   r(n) = r0 (r_end / r0) ** (n / N)        Kaldi's decay (the default)
    hand          r(n) = r0 f ** n                          You & Xu's ASGD-hand, f = 0.999
    adapt         r(n) = r0 = gamma                         the per-parameter part is the
                                                            optimizer's (``adapt.py``)
    search        r constant within a chunk, chosen before it by trials (``search.py``)
    newbob        r halved at epoch ends by held-out gains (``newbob.py``)

Every decision a schedule takes comes from step counts or from figures already
summed over all ranks, so the rate is the same on every rank.  What continues
a schedule exactly is :meth:`Schedule.state_dict`: named scalars, which the
trainer keeps in the checkpoint's group 'trainer'.  The trainer multiplies the
rate by the divergence guard's roll-back scale.

Example::

    sched = HandSchedule(0.008, factor=0.999)
    sched.rate(0), sched.rate(1000)        # 0.008, 0.008 * 0.999 ** 1000
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod


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


class Schedule(ABC):
    """A rate per step, plus the hooks the trainer calls for the schedules that decide.

    Subclasses define :meth:`rate`; those with state override :meth:`state_dict`
    and :meth:`load_state_dict`; ``search`` answers :meth:`search_due`, and
    ``newbob`` sets ``uses_epoch_eval`` and answers :meth:`end_epoch`.

    Example::

        class Constant(Schedule):
            name = "constant"
            def rate(self, step): return 0.001
    """

    name = "schedule"
    #: whether the trainer must evaluate on held-out data at every epoch end
    uses_epoch_eval = False

    @abstractmethod
    def rate(self, step: int) -> float:
        """The learning rate of 0-based step ``step``."""

    @property
    def stopped(self) -> bool:
        """True once the schedule ended training early (newbob)."""
        return False

    def search_due(self, step: int) -> bool:
        """Whether rates must be tried before step ``step`` (search)."""
        return False

    def end_epoch(self, dev_xent: float, dev_acc: float) -> dict:
        """Take the epoch's held-out results; returns what was decided (for the log)."""
        return {}

    def after_roll_back(self) -> None:
        """The trainer rolled back to a checkpoint (this schedule's state restored) and
        lowered its rate scale, because training diverged."""

    def state_dict(self) -> dict:
        """Named scalars that continue this schedule exactly."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s result."""


class PlannedExponential(Schedule):
    """``exponential``: :class:`ExponentialSchedule` over the planned steps.

    Example::

        PlannedExponential(0.004, 0.0004, planned_steps=1000).rate(500)   # ~0.00126

    ``progress`` (step -> fraction of the planned training data trained before it)
    replaces step / planned_steps where the data per step varies (Kaldi's job ramp).
    """

    name = "exponential"

    def __init__(self, initial: float, final: float, *, planned_steps: int, progress=None):
        self.curve = ExponentialSchedule(initial, final)
        self.planned_steps = max(int(planned_steps), 1)
        # step -> the fraction of the planned data trained before it (None: step / planned)
        self.progress = progress

    def rate(self, step: int) -> float:
        if self.progress is not None:
            return self.curve(self.progress(step))
        return self.curve(step / self.planned_steps)


class HandSchedule(Schedule):
    """``hand``: the rate times ``factor`` after every minibatch; a function of the step
    alone, so the step count in the checkpoint continues it.

    Example::

        HandSchedule(0.008, factor=0.999).rate(3)    # 0.008 * 0.999 ** 3
    """

    name = "hand"

    def __init__(self, initial: float, *, factor: float):
        if initial <= 0 or not 0 < factor <= 1:
            raise ValueError(f"hand schedule: need initial > 0 and factor in (0, 1], got "
                             f"{initial}, {factor}")
        self.initial, self.factor = float(initial), float(factor)

    def rate(self, step: int) -> float:
        return self.initial * self.factor ** int(step)


class ConstantSchedule(Schedule):
    """``adapt``: the global rate gamma stays constant; the optimizer scales each
    parameter's step (:class:`~mpitrain.optim.adapt.LimitedMemoryAdagrad`).

    Example::

        ConstantSchedule(0.008).rate(10 ** 6)    # 0.008
    """

    name = "adapt"

    def __init__(self, rate: float):
        if rate <= 0:
            raise ValueError(f"learning rate must be > 0, got {rate}")
        self._rate = float(rate)

    def rate(self, step: int) -> float:
        return self._rate
