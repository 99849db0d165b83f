"""The trainer's own training step, fed from an in-memory chunk: what every benchmark runs.

:class:`TrainerSteps` builds the objects ``Trainer`` builds (``build_network``,
``build_optimizer``, ``build_strategy`` or the no-communication ``Strategy``
base class) and runs :class:`~mpitrain.train.step.TrainingStep` on them, with
minibatches taken in turn from a shuffled chunk of
:func:`~mpitrain.bench.models.synthetic_chunk`: splice from unspliced frames,
forward/backward, the strategy's gradient hook, SGD (or NG-SGD) with
max-change, the strategy's after-update hook.  The benchmarks differ only in
what they time around it and what they report.

Example::

    model = THROUGHPUT_MODELS["quick"]
    steps = TrainerSteps(model, *synthetic_chunk(model, 20_000))
    steps.run(16)
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .models import ModelSpec

#: ``method`` left at this: the configuration's default method (``parallel.method``).
CONFIG_METHOD = "config"


class TrainerSteps:
    """The trainer's per-step work on a synthetic chunk, one step per :meth:`step`.

    ``comm``: the communicator the strategy uses (None: a one-rank
    communicator).  ``method``: a ``parallel.method`` name, None for no
    communication at all, or :data:`CONFIG_METHOD` for the config's default.
    ``every``: minibatches between averages.  ``lr_decay``: the config's
    exponential schedule over ``total_steps`` (as the trainer decays it), or
    False for the initial rate at every step (a steady state that does not
    change between timed rounds).  ``total_steps`` 0: ten passes over the chunk.

    Example::

        steps = TrainerSteps(model, chunk, order, comm=comm, method="allreduce",
                             lr_decay=False)
        steps.run(8)
        steps.training_step.take_sums()
    """

    def __init__(self, model: ModelSpec, chunk, order, *, comm=None,
                 method: Optional[str] = CONFIG_METHOD, every: int = 8, total_steps: int = 0,
                 lr_decay: bool = True, optimizer: str = "sgd", ngsgd_variant: str = "online",
                 xp=np, seed: int = 1, cuda_graph: bool = False,
                 ngsgd_delayed_updates: bool = False, plan_threads: int = 0):
        from mpitrain import backend
        from mpitrain.comm.single import SingleCommunicator
        from mpitrain.config import RunConfig
        from mpitrain.data.batcher import Chunk
        from mpitrain.nn.network import build_network
        from mpitrain.optim.factory import build_optimizer
        from mpitrain.optim.schedule import ExponentialSchedule
        from mpitrain.parallel.base import Strategy
        from mpitrain.parallel.registry import build_strategy
        from mpitrain.train.step import TrainingStep

        cfg = RunConfig()
        cfg.model.hidden_layers, cfg.model.hidden_dim = model.hidden_layers, model.hidden_dim
        cfg.training.minibatch = model.minibatch
        cfg.data.left_context, cfg.data.right_context = model.left_context, model.right_context
        cfg.optimizer.name = optimizer
        cfg.optimizer.ngsgd.variant = ngsgd_variant
        cfg.optimizer.ngsgd.delayed_updates = ngsgd_delayed_updates
        cfg.optimizer.ngsgd.plan_threads = plan_threads
        cfg.parallel.average_every = every
        comm = comm if comm is not None else SingleCommunicator()
        self.cfg, self.model, self.xp = cfg, model, xp
        # the chunk on the network's device, as the minibatch stream loads it
        self.chunk = Chunk(chunk.spec, *(backend.to_device(a, xp) for a in
                                         (chunk.feats, chunk.labels, chunk.utt_start,
                                          chunk.utt_end)))
        self.order = backend.to_device(order, xp)
        self.net = build_network(
            feat_dim=model.feat_dim, num_classes=model.num_classes,
            left_context=model.left_context, right_context=model.right_context,
            hidden_layers=model.hidden_layers, hidden_dim=model.hidden_dim,
            nonlinearity="relu", xp=xp)
        self.net.init_params(seed=seed)
        self.batches = len(order) // model.minibatch
        self.planned_steps = total_steps or 10 * self.batches
        self.optimizer = build_optimizer(cfg.optimizer, self.net, minibatch=model.minibatch)
        if method is None:
            self.strategy = Strategy(comm)
        else:
            if method != CONFIG_METHOD:
                cfg.parallel.method = method
            self.strategy = build_strategy(cfg, comm, total_steps=self.planned_steps)
        self.strategy.setup(self.net, self.optimizer)
        initial = cfg.optimizer.initial_learning_rate
        self.schedule = ExponentialSchedule(initial, cfg.optimizer.final_learning_rate) \
            if lr_decay else (lambda progress: initial)
        self.training_step = TrainingStep(self.net, self.optimizer, self.strategy,
                                          minibatch=model.minibatch,
                                          left_context=model.left_context,
                                          right_context=model.right_context,
                                          cuda_graph=cuda_graph)
        self.step_count = 0

    def learning_rate(self) -> float:
        """The schedule's rate for the next step (before the strategy scales it)."""
        fraction = self.strategy.rate_fraction(self.step_count)   # as Trainer.rate_progress
        return self.schedule(self.step_count / self.planned_steps if fraction is None
                             else fraction)

    def next_batch(self):
        """The next minibatch: ``(chunk, frame indices)``, walking the shuffled order."""
        b = self.model.minibatch
        pos = self.step_count % self.batches
        return self.chunk, self.order[pos * b:(pos + 1) * b]

    def step(self) -> None:
        """One training step, exactly as ``Trainer.run`` takes it."""
        self.training_step.run(self.step_count, self.learning_rate(), self.next_batch)
        self.step_count += 1

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
