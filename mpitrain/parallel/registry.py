"""The parallel methods by name: ``parallel.method`` -> the module that implements it.

This module imports no strategy, so the configuration can validate a method
name against :data:`METHODS` without loading any strategy's code.  A new
method is one module in this package with a ``build(cfg, comm, *,
total_steps)`` function, and one entry here; every tool that enumerates
methods (the benchmark mode among them) then picks it up.

Example::

    strategy = build_strategy(cfg, comm, total_steps=1000)
    sorted(METHODS)     # ['adpsgd', 'allreduce', 'bmuf', 'kaldi', 'model_averaging',
                        #  'param_server']
    data_share(cfg, rank=0, size=4)     # (0, 4): rank 0 trains on part 0 of 4
"""

from __future__ import annotations

import importlib

#: ``parallel.method`` name -> module of :mod:`mpitrain.parallel` defining ``build``.
METHODS = {
    "model_averaging": "model_averaging",
    "allreduce": "gradient_allreduce",
    "kaldi": "kaldi_averaging",
    "bmuf": "bmuf",
    "adpsgd": "adpsgd",
    "param_server": "param_server",
}

#: Methods whose ranks take their own numbers of steps (no collective in between).
ASYNCHRONOUS_METHODS = ("param_server",)


def takes_own_steps(cfg) -> bool:
    """Whether the ranks take their own numbers of steps: the asynchronous methods,
    and ADPSGD with ``parallel.asynchronous``."""
    par = cfg.parallel
    return par.method in ASYNCHRONOUS_METHODS or (par.method == "adpsgd" and par.asynchronous)


def build_strategy(cfg, comm, *, total_steps: int = 0):
    """The strategy named by ``cfg.parallel.method``, over ``comm``, with this rank's
    ``parallel.straggler`` slowdown attached (``strategy.straggler``, None if none)."""
    try:
        module = METHODS[cfg.parallel.method]
    except KeyError:
        raise ValueError(f"parallel.method: unknown method {cfg.parallel.method!r}; "
                         f"expected one of {', '.join(METHODS)}") from None
    if module == "adpsgd" and cfg.parallel.asynchronous:
        module = "async_adpsgd"         # the papers' asynchronous form
    elif module == "adpsgd" and cfg.parallel.hierarchical:
        module = "hierarchical_adpsgd"  # allreduce inside a node, the ring across
    strategy = importlib.import_module(f"{__package__}.{module}").build(
        cfg, comm, total_steps=total_steps)
    strategy.straggler = straggler_of(cfg, comm)
    return strategy


def straggler_of(cfg, comm, *, repeat: int = 0):
    """This rank's ``parallel.straggler`` slowdown (None if it is not slowed);
    ``repeat``: a benchmark's repeat of a run, its own jitter draw."""
    from .straggler import build_straggler
    slow = cfg.parallel.straggler
    return build_straggler(slow.ranks, comm, slowdown=slow.slowdown, jitter=slow.jitter,
                           seed=cfg.training.seed, repeat=repeat)


def data_share(cfg, *, rank: int, size: int) -> tuple:
    """(share, shares): ``rank`` trains on part ``share`` of ``shares`` equal parts of
    the training data; share None: on none (a parameter server).  (rank, size)
    unless the method's module says otherwise with its own ``data_share``."""
    module = METHODS.get(cfg.parallel.method)
    if module is None:
        return rank, size
    own = getattr(importlib.import_module(f"{__package__}.{module}"), "data_share", None)
    return (rank, size) if own is None else own(rank, size, servers=cfg.parallel.servers)
