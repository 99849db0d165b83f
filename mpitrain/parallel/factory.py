"""Build the strategy named by ``parallel.method``."""

from __future__ import annotations

from .averaging import GradientAllreduce, ModelAveraging


def build_strategy(cfg, comm):
    """Example::

        strategy = build_strategy(cfg, comm)
    """
    par = cfg.parallel
    every = par.average_every
    if par.average_every_frames:
        every = max(1, par.average_every_frames // cfg.training.minibatch)
    reset = cfg.optimizer.ngsgd.reset_on_average
    if par.method == "model_averaging":
        return ModelAveraging(comm, every_steps=every, average_momentum=par.average_momentum,
                              reset_preconditioners=reset)
    if par.method == "allreduce":
        return GradientAllreduce(comm)
    raise ValueError(f"parallel.method: {par.method!r} is not available in this build; "
                     "expected 'model_averaging' or 'allreduce'")
