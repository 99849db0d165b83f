"""Build the strategy named by ``parallel.method``.

:data:`METHODS` maps each method name to its builder; a new strategy is one
builder and one entry here, and every tool that enumerates methods (the
benchmark mode among them) picks it up.
"""

from __future__ import annotations

from .averaging import GradientAllreduce, ModelAveraging


def _every_steps(cfg) -> int:
    """Minibatches between syncs: ``average_every_frames`` wins when set."""
    par = cfg.parallel
    if par.average_every_frames:
        return max(1, par.average_every_frames // cfg.training.minibatch)
    return par.average_every


def _model_averaging(cfg, comm, *, total_steps: int):
    return ModelAveraging(comm, every_steps=_every_steps(cfg),
                          average_momentum=cfg.parallel.average_momentum,
                          reset_preconditioners=cfg.optimizer.ngsgd.reset_on_average)


def _allreduce(cfg, comm, *, total_steps: int):
    return GradientAllreduce(comm, overlap=cfg.parallel.overlap,
                             bucket_bytes=int(cfg.parallel.bucket_mb * (1 << 20)))


def _kaldi(cfg, comm, *, total_steps: int):
    from .kaldi import KaldiAveraging
    par = cfg.parallel
    return KaldiAveraging(comm, every_steps=_every_steps(cfg), total_steps=total_steps,
                          jobs_initial=par.num_jobs_initial, jobs_final=par.num_jobs_final,
                          jobs_step=par.jobs_step,
                          reset_preconditioners=cfg.optimizer.ngsgd.reset_on_average)


def _bmuf(cfg, comm, *, total_steps: int):
    from .bmuf import BlockMomentum
    par = cfg.parallel
    return BlockMomentum(comm, every_steps=_every_steps(cfg),
                         block_momentum=None if par.block_momentum < 0 else par.block_momentum,
                         block_lr=par.block_lr, nesterov=par.nesterov,
                         reset_preconditioners=cfg.optimizer.ngsgd.reset_on_average)


#: ``parallel.method`` name -> builder ``(cfg, comm, *, total_steps) -> Strategy``.
METHODS = {
    "model_averaging": _model_averaging,
    "allreduce": _allreduce,
    "kaldi": _kaldi,
    "bmuf": _bmuf,
}


def build_strategy(cfg, comm, *, total_steps: int = 0):
    """Example::

        strategy = build_strategy(cfg, comm)
        sorted(METHODS)     # ['allreduce', 'bmuf', 'kaldi', 'model_averaging']
    """
    try:
        builder = METHODS[cfg.parallel.method]
    except KeyError:
        raise ValueError(f"parallel.method: unknown method {cfg.parallel.method!r}; "
                         f"expected one of {', '.join(METHODS)}") from None
    return builder(cfg, comm, total_steps=total_steps)
