"""``newbob``: the multi-pass baseline's rate, halved by held-out gains (QuickNet's rule).

Rule, at the end of every epoch but the last, on the held-out cross-entropy
x_e and frame accuracy a_e (per frame over all ranks' frames, so identical everywhere)::

    gain_x = (x_{e-1} - x_e) / x_{e-1}          relative cross-entropy gain
    gain_a = a_e - a_{e-1}                       absolute accuracy gain
    if halving and gain_a < stop:   stop training          (optimizer.newbob_stop)
    elif gain_x < start:            halving <- True        (optimizer.newbob_start_halving)
    if halving and not stopped:     r <- r / 2

The first epoch only sets x_0, a_0.  The rate starts at
``optimizer.initial_learning_rate`` and stays there until halving starts; the
stop test waits for halving, as in QuickNet, so one noisy early epoch does
not end the run.  ``training.epochs`` is the most passes it may take.  An
epoch that got worse is kept (Kaldi nnet1 would undo it).

Example::

    sched = NewbobSchedule(0.004, start_halving=0.005, stop=0.001)
    sched.end_epoch(2.0, 0.50); sched.end_epoch(1.999, 0.51)   # halving: rate 0.002
"""

from __future__ import annotations

import math

from ..state_fields import count, flag, number
from .schedule import Schedule

#: The factor on the rate at each halving epoch.
HALVING = 0.5


class NewbobSchedule(Schedule):
    """See the module docstring."""

    name = "newbob"
    uses_epoch_eval = True

    def __init__(self, initial: float, *, start_halving: float, stop: float):
        if initial <= 0 or start_halving < 0 or stop < 0:
            raise ValueError(f"newbob schedule: need initial > 0 and thresholds >= 0, got "
                             f"{initial}, {start_halving}, {stop}")
        self.initial = self.current = float(initial)
        self.start_halving, self.stop = float(start_halving), float(stop)
        self.last_xent = self.last_acc = None
        self.halving = False
        self._stopped = False
        self.epochs = 0

    def rate(self, step: int) -> float:
        return self.current

    @property
    def stopped(self) -> bool:
        return self._stopped

    def end_epoch(self, dev_xent: float, dev_acc: float) -> dict:
        dev_xent, dev_acc = float(dev_xent), float(dev_acc)
        self.epochs += 1
        decision = {"epoch": self.epochs}
        if self.last_xent is not None:
            gain_x = (self.last_xent - dev_xent) / self.last_xent if self.last_xent else 0.0
            gain_a = dev_acc - self.last_acc
            if not (math.isfinite(gain_x) and math.isfinite(gain_a)):
                gain_x = gain_a = -math.inf
            if self.halving and gain_a < self.stop:
                self._stopped = True
            elif gain_x < self.start_halving:
                self.halving = True
            if self.halving and not self._stopped:
                self.current *= HALVING
            decision.update(xent_gain=gain_x, acc_gain=gain_a)
        self.last_xent, self.last_acc = dev_xent, dev_acc
        decision.update(rate=self.current, halving=self.halving, stopped=self._stopped)
        return decision

    def state_dict(self) -> dict:
        return {"rate": self.current, "last_xent": self.last_xent, "last_acc": self.last_acc,
                "halving": self.halving, "stopped": self._stopped, "epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        where = "newbob schedule state"
        if "rate" not in state:
            raise ValueError(f"{where}: missing 'rate'")
        # the rate only halves from the initial one, once an epoch at most
        epochs = count(state, "epochs", where, default=0)
        rate = number(state, "rate", where, low=0.0, low_open=True, high=self.initial)
        if rate < self.initial * HALVING ** min(epochs, 2000):
            raise ValueError(f"{where}: field 'rate': {rate:g} is below the initial rate "
                             f"{self.initial:g} halved once per epoch ({epochs} epochs)")
        # (held-out cross-entropy is >= 0, accuracy a fraction)
        last_xent = number(state, "last_xent", where, default=None, low=0.0)
        last_acc = number(state, "last_acc", where, default=None, low=0.0, high=1.0)
        halving = flag(state, "halving", where, default=False)
        stopped = flag(state, "stopped", where, default=False)
        self.current, self.epochs = rate, epochs
        self.last_xent, self.last_acc = last_xent, last_acc
        self.halving, self._stopped = halving, stopped
