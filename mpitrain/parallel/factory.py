"""Build the strategy named by ``parallel.method``."""

from __future__ import annotations

from .averaging import GradientAllreduce, ModelAveraging


def build_strategy(cfg, comm, *, total_steps: int = 0):
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
        return GradientAllreduce(comm, overlap=par.overlap,
                                 bucket_bytes=int(par.bucket_mb * (1 << 20)))
    if par.method == "kaldi":
        from .kaldi import KaldiAveraging
        return KaldiAveraging(comm, every_steps=every, total_steps=total_steps,
                              jobs_initial=par.num_jobs_initial, jobs_final=par.num_jobs_final,
                              jobs_step=par.jobs_step, reset_preconditioners=reset)
    if par.method == "bmuf":
        from .bmuf import BlockMomentum
        return BlockMomentum(comm, every_steps=every,
                             block_momentum=None if par.block_momentum < 0 else par.block_momentum,
                             block_lr=par.block_lr, nesterov=par.nesterov,
                             reset_preconditioners=reset)
    raise ValueError(f"parallel.method: unknown method {par.method!r}")
