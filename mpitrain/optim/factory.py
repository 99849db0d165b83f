"""Build the optimizer and the learning-rate schedule named in the config: the one
place where ``optimizer.name`` and ``optimizer.schedule`` become classes."""

from __future__ import annotations

import math

from .sgd import SGD


def build_optimizer(opt_cfg, net, *, minibatch: int = 0):
    """``minibatch``: frames per gradient (needed by L2 regularization).

    Example::

        opt = build_optimizer(cfg.optimizer, net, minibatch=256)   # SGD or NaturalGradientSGD
    """
    options = dict(momentum=opt_cfg.momentum, max_change_per_layer=opt_cfg.max_change_per_layer,
                   max_change_output=opt_cfg.max_change_output, max_change=opt_cfg.max_change,
                   l2_regularize=opt_cfg.l2_regularize,
                   l2_regularize_output=opt_cfg.l2_regularize_output, minibatch=minibatch,
                   max_change_per_sample=opt_cfg.max_change_per_sample)
    if opt_cfg.schedule == "adapt":
        from .adapt import LimitedMemoryAdagrad
        options["gradient_scaling"] = LimitedMemoryAdagrad(net.params, k=opt_cfg.adapt_k,
                                                           decay=opt_cfg.adapt_decay)
    if opt_cfg.name == "sgd":
        return SGD(net, **options)
    from .ngsgd import NaturalGradientSGD
    ng = opt_cfg.ngsgd
    return NaturalGradientSGD(net, variant=ng.variant, rank_in=ng.rank_in, rank_out=ng.rank_out,
                              update_period=ng.update_period,
                              num_samples_history=ng.num_samples_history, alpha=ng.alpha,
                              reset_on_average=ng.reset_on_average,
                              delayed_updates=ng.delayed_updates,
                              plan_threads=ng.plan_threads, **options)


def build_schedule(opt_cfg, *, planned_steps: int, frames_per_step: int, progress=None,
                   rate_limit: float = math.inf):
    """The schedule of ``optimizer.schedule``; ``planned_steps``: the steps of the
    planned run (search's chunks are no longer); ``frames_per_step``: frames one step
    trains over all ranks (search cuts its chunks by it); ``progress``: step -> the
    fraction of the planned data trained before it, for ``exponential`` (default
    step / planned_steps); ``rate_limit``: the rate search tries no factor at or
    above (where the L2 term alone zeroes the weights).

    Example::

        sched = build_schedule(cfg.optimizer, planned_steps=3000, frames_per_step=512)
        rate = sched.rate(step)
    """
    from .schedule import ConstantSchedule, HandSchedule, PlannedExponential
    name, initial = opt_cfg.schedule, opt_cfg.initial_learning_rate
    if name == "exponential":
        return PlannedExponential(initial, opt_cfg.final_learning_rate,
                                  planned_steps=planned_steps, progress=progress)
    if name == "hand":
        return HandSchedule(initial, factor=opt_cfg.hand_factor)
    if name == "adapt":
        return ConstantSchedule(initial)
    if name == "search":
        from .search import SearchSchedule
        # a run shorter than a chunk is one chunk: a trial is a share of what the run
        # trains, never more (long trials went round a small corpus many times)
        chunk_steps = max(1, min(round(opt_cfg.search_chunk_frames / max(frames_per_step, 1)),
                                 planned_steps))
        # at least two: a trial scores each minibatch before its update, so the first
        # score is the same at every rate and one minibatch alone cannot tell them apart
        trial_steps = max(2, round(opt_cfg.search_trial_fraction * chunk_steps))
        return SearchSchedule(initial, factors=opt_cfg.search_factors, chunk_steps=chunk_steps,
                              trial_steps=trial_steps, rate_limit=rate_limit)
    if name == "newbob":
        from .newbob import NewbobSchedule
        return NewbobSchedule(initial, start_halving=opt_cfg.newbob_start_halving,
                              stop=opt_cfg.newbob_stop)
    raise ValueError(f"optimizer.schedule: unknown schedule {name!r}")
