"""The Strategy interface: the hooks the trainer calls around each step.

A strategy talks to other ranks only through a
:class:`~mpitrain.comm.base.Communicator` and touches only the network's flat
buffers and what :class:`~mpitrain.optim.base.Optimizer` offers, so the
trainer, the layers and the optimizers never see MPI.
"""

from __future__ import annotations


class Strategy:
    """Base class; on one rank every hook is a no-op.

    Hooks, in the order the trainer calls them:

    - ``setup(net, optimizer)``: before the first step (broadcast rank 0's model);
      when resuming instead ``bind(net)``, ``load_state_dict(state)`` and
      ``resume(net)`` (which sets the parameters training continues from).
    - ``is_active(step)``: whether this rank trains at 0-based ``step``.
    - ``learning_rate(lr, step)``: the rate to use, given the schedule's;
      ``l2_factor(step)``: what the L2 term is scaled by at that rate;
      ``max_change_factor(step)``: what the whole-model max-change is scaled by.
    - ``data_fraction(step)``: how far through the planned data the run is, when
      that is not in proportion to the steps (None: it is); ``rate_fraction(step)``
      where the rate schedule stands (the same, unless the method says otherwise).
    - ``reduce_gradients(net)``: after backward, before the optimizer step.
    - ``after_update(net, optimizer, step)``: after ``step`` steps (periodic averaging).
    - ``finalize(net, optimizer, step)``: at the end; all ranks agree on the model.

    ``sync_period``: steps between points where all ranks hold the same model;
    checkpoints are taken only there, so a resumed run continues exactly.
    A strategy whose ranks never agree (ADPSGD) keeps each rank's own model
    in :meth:`rank_state_dict`.

    ``straggler``: set by :func:`~mpitrain.parallel.registry.build_strategy` on
    the ranks ``parallel.straggler`` makes slow (a
    :class:`~mpitrain.parallel.straggler.Straggler`), None elsewhere; the
    training step calls it around each step.

    Example::

        strategy = Strategy(comm)
        strategy.setup(net, opt)
    """

    name = "local"
    sync_period = 1
    #: True when ``reduce_gradients`` communicates (a step is then not one
    #: fixed piece of device work that a CUDA graph could replay).
    reduces_gradients = False
    straggler = None

    def __init__(self, comm):
        self.comm = comm

    def setup(self, net, optimizer) -> None:
        if self.comm.size > 1:
            self.comm.bcast_(net.params, root=0)

    def bind(self, net) -> None:
        pass

    def is_active(self, step: int) -> bool:
        return True

    def active_ranks(self, step: int) -> int:
        return self.comm.size

    def learning_rate(self, lr: float, step: int = 0) -> float:
        return lr

    def l2_factor(self, step: int = 0) -> float:
        return 1.0

    def max_change_factor(self, step: int = 0) -> float:
        """What the whole-model max-change is scaled by at 0-based ``step``."""
        return 1.0

    def data_fraction(self, step: int):
        """The fraction of the planned run's minibatches (all ranks together) trained
        before 0-based ``step``, where it is not ``step / planned steps`` (ranks sitting
        steps out by plan); else None.  Schedules over the planned data follow it."""
        return None

    def rate_fraction(self, step: int):
        """Where the learning-rate schedule stands at 0-based ``step``, as a fraction
        of the planned data: :meth:`data_fraction`, unless the method sets the rate
        otherwise (Kaldi's last iteration at the final rate); None: the steps'."""
        return self.data_fraction(step)

    def reduce_gradients(self, net) -> None:
        pass

    def after_update(self, net, optimizer, step: int) -> None:
        pass

    def finalize(self, net, optimizer, step: int = 0) -> None:
        pass

    def average_models_(self, params, step: int) -> None:
        """``params`` <- the ranks' differing models after ``step`` steps combined as
        the method combines them (what a run ending there would keep), on every
        rank: the plain mean unless the method weighs the ranks otherwise."""
        self.comm.allreduce_(params, op="mean")

    def models_agree(self, step: int) -> bool:
        """Whether every rank holds the same model after ``step`` steps."""
        return self.comm.size == 1 or step % self.sync_period == 0

    def can_checkpoint(self, step: int) -> bool:
        """Whether a checkpoint after ``step`` steps holds all that a resumed run
        needs to continue exactly: at sync points, and after any step of one rank."""
        return self.comm.size == 1 or step % self.sync_period == 0

    def result_params(self):
        """The job's model when it is not what the ranks train on (the same on every
        rank), else None: what is evaluated, kept as best and checkpointed."""
        return None

    def state_dict(self) -> dict:
        """State to checkpoint (identical on every rank)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def resume(self, net) -> None:
        """After :meth:`load_state_dict` on resume: the parameters continue as saved."""

    def rank_state_dict(self) -> dict:
        """This rank's own state to checkpoint (host arrays, numbers); {} when the
        ranks agree at every checkpoint."""
        return {}

    def load_rank_state_dict(self, state: dict) -> None:
        """Restore :meth:`rank_state_dict`'s result (resume on the same number of ranks)."""

    def close(self) -> None:
        """Release what the strategy holds beyond its run (communicators it split
        off, with their device routes); collective, as freeing them is.  The
        trainer calls it when it closes; a process that builds many strategies (a
        benchmark) would otherwise keep every one's."""


def every_steps_from(cfg) -> int:
    """Minibatches between syncs (the config's rule, which its checks share)."""
    return cfg.sync_steps()
