"""Model averaging every K minibatches (Su & Chen, "Scaling deep learning on
multiple in-memory processors" / MPI Allreduce model averaging on many GPUs,
with NG-SGD as in Povey, Zhang & Khudanpur).

The rule, for N ranks with parameters w_i, every K local steps::

    w_i <- (1/N) sum_j w_j          one in-place Allreduce of the flat buffer

Each rank trains on its own data between averages; optimizer state stays
local unless ``average_momentum`` (then the momentum buffers are averaged
too), and the optimizer hears :meth:`~mpitrain.optim.base.Optimizer.after_average`
(NG-SGD with ``optimizer.ngsgd.reset_on_average`` then starts fresh Fisher
estimates, as each Kaldi job does; by default it keeps them).  With
K = 1 and plain SGD this equals synchronous SGD from a common start.

With ``straggler_policy: adapt`` a slow rank no longer holds everyone up:
each rank measures its compute time per minibatch t_i (wall time less time
inside the communicator, smoothed over periods), the ranks share them at
each average, and in the next period rank i trains only

    q_i = clamp(round(K t_min / t_i), 1, K)     (K when t_i <= 1.1 t_min)

of the K minibatches, spread evenly (at period positions p with
p q_i mod K < q_i; it sits the others out), so every rank reaches the average,
and any collective in between (a log line's sums), at about the same time.  The average weights each model by the frames it saw
in the period::

    w_i <- sum_j q_j w_j / sum_j q_j

All ranks compute the same quotas from the same shared times.  A run with
the policy is not bit-reproducible (the quotas follow measured times).

Symbols in the code: K is ``every_steps``, w_i is ``net.params``, N is
``comm.size``, q_i is ``quotas[i]``, t_i is ``step_seconds[i]``.
"""

from __future__ import annotations

import numpy as np

from ..state_fields import float32_buffer, int_array
from .base import Strategy, every_steps_from

#: ``parallel.straggler_policy`` values.
STRAGGLER_POLICIES = ("none", "adapt")
# weight of the newest period's time in each rank's smoothed time per minibatch
_TIME_SMOOTHING = 0.5
# a rank this much slower than the fastest still trains every minibatch: timing
# noise (a shared node, oversubscribed cores) must not cost a balanced job frames
SLOWER_TOLERANCE = 0.10


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: model_averaging``."""
    return ModelAveraging(comm, every_steps=every_steps_from(cfg),
                          average_momentum=cfg.parallel.average_momentum,
                          straggler_policy=cfg.parallel.straggler_policy)


class ModelAveraging(Strategy):
    """Example::

        strategy = ModelAveraging(comm, every_steps=8)
    """

    name = "model_averaging"

    def __init__(self, comm, *, every_steps: int = 8, average_momentum: bool = False,
                 straggler_policy: str = "none"):
        super().__init__(comm)
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        if straggler_policy not in STRAGGLER_POLICIES:
            raise ValueError(f"straggler_policy must be one of "
                             f"{', '.join(STRAGGLER_POLICIES)}, got {straggler_policy!r}")
        self.every_steps = int(every_steps)
        self.average_momentum = average_momentum
        self.num_averages = 0
        self.sync_period = self.every_steps
        self.adapt = straggler_policy == "adapt" and comm.size > 1
        # straggler_policy adapt: minibatches each rank trains per period, and
        # each rank's smoothed compute seconds per minibatch (0: not measured yet)
        self.quotas = [self.every_steps] * comm.size
        self.step_seconds = [0.0] * comm.size
        self._period_start = None       # (wtime, comm_time) when this period began

    # -- straggler_policy: adapt ------------------------------------------------------
    def is_active(self, step: int) -> bool:
        if not self.adapt:
            return True
        if self._period_start is None:       # the clock starts at the first step
            self._period_start = (self.comm.wtime(), self.comm.comm_time)
        return self._trains_at(step % self.every_steps, self.quotas[self.comm.rank])

    def active_ranks(self, step: int) -> int:
        if not self.adapt:
            return self.comm.size
        return sum(self._trains_at(step % self.every_steps, q) for q in self.quotas)

    def _trains_at(self, position: int, quota: int) -> bool:
        """Whether a rank with ``quota`` trains at ``position`` of a period: ``quota``
        of the K positions, evenly spread, the first one included."""
        return position * quota % self.every_steps < quota

    def _share_step_times(self, trained: int) -> None:
        """Every rank's time per minibatch this period (``trained`` minibatches here),
        shared; the next quotas."""
        start_wall, start_comm = self._period_start
        comm_seconds = self.comm.comm_time - start_comm
        if comm_seconds < 0:                    # the counter was reset meanwhile
            comm_seconds = self.comm.comm_time
        compute = max(self.comm.wtime() - start_wall - comm_seconds, 0.0)
        mine = np.zeros(self.comm.size, dtype=np.float64)
        mine[self.comm.rank] = compute / max(trained, 1)
        self.comm.allreduce_(mine, op="sum")
        for rank, seconds in enumerate(mine):
            old = self.step_seconds[rank]
            self.step_seconds[rank] = float(seconds) if old == 0.0 else \
                (1 - _TIME_SMOOTHING) * old + _TIME_SMOOTHING * float(seconds)
        k = self.every_steps
        measured = [t for t in self.step_seconds if t > 0]
        fastest = min(measured) if measured else 0.0
        self.quotas = [k if t <= fastest * (1 + SLOWER_TOLERANCE)
                       else int(min(k, max(1, round(k * fastest / t))))
                       for t in self.step_seconds]

    def _weighted_mean_(self, buf, quotas) -> None:
        """buf <- sum_j q_j buf_j / sum_j q_j (the plain mean when the q_j are equal)."""
        if len(set(quotas)) == 1:
            self.comm.allreduce_(buf, op="mean")
            return
        buf *= buf.dtype.type(quotas[self.comm.rank] / sum(quotas))
        self.comm.allreduce_(buf, op="sum")

    def after_update(self, net, optimizer, step: int) -> None:
        if step % self.every_steps == 0:
            self.average(net, optimizer)

    def average(self, net, optimizer, period_steps: int = 0) -> None:
        """Average the models after a period of ``period_steps`` steps (0: K)."""
        if self.comm.size == 1:
            return
        length = period_steps or self.every_steps
        # the minibatches each rank trained in the period that ends: its weight
        quotas = [sum(self._trains_at(p, q) for p in range(length)) for q in self.quotas]
        if self.adapt and self._period_start is not None:
            self._share_step_times(quotas[self.comm.rank])
        self._weighted_mean_(net.params, quotas)
        momentum = optimizer.momentum_buffer()
        if self.average_momentum and momentum is not None:
            self._weighted_mean_(momentum, quotas)
        optimizer.after_average()
        self.num_averages += 1
        if self.adapt:
            self._period_start = (self.comm.wtime(), self.comm.comm_time)

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if not self.adapt:
            return {}
        return {"quotas": np.asarray(self.quotas, dtype=np.int64),
                "step_seconds": np.asarray(self.step_seconds, dtype=np.float64)}

    def load_state_dict(self, state: dict) -> None:
        if not self.adapt or "quotas" not in state:
            return
        # a quota is a number of a period's K minibatches, at least one; a time is
        # a smoothed measure of seconds, one per rank
        where = "checkpoint group 'strategy' (straggler_policy adapt)"
        # (at most parallel.average_every)
        quotas = int_array(state["quotas"], f"{where}: field 'quotas'", low=1,
                           high=self.every_steps, empty=False)
        # (checked as float32's range; kept as stored, in float64)
        float32_buffer(state.get("step_seconds"), quotas.shape,
                       f"{where}: field 'step_seconds'", low=0.0)
        if len(quotas) == self.comm.size:        # another number of ranks: start afresh
            self.quotas = [int(q) for q in quotas]
            self.step_seconds = [float(t) for t in state["step_seconds"]]

    def average_models_(self, params, step: int) -> None:
        # weighted as the period's end weighs them (straggler_policy adapt: by the
        # minibatches each rank trained so far in the period)
        length = step % self.every_steps or self.every_steps
        self._weighted_mean_(params, [sum(self._trains_at(p, q) for p in range(length))
                                      for q in self.quotas])

    def finalize(self, net, optimizer, step: int = 0) -> None:
        # the last block may be shorter than K: average once more so all agree
        if step % self.every_steps:
            self.average(net, optimizer, period_steps=step % self.every_steps)
