"""The optimizer contract: what the trainer, the strategies and the step may use.

An optimizer updates ``net.params`` from ``net.grads`` in :meth:`Optimizer.step`.
A parallel strategy touches an optimizer only through this interface: the
buffer averaging may include (:meth:`momentum_buffer`), clearing it
(:meth:`clear_momentum`), the signal that the ranks' models were just
averaged (:meth:`after_average`) and stepping only a slice of the model
(:meth:`restrict_to`, a parameter server's).  Checkpoints go through
:meth:`state_dict`/:meth:`load_state_dict` (host arrays and plain values).
:class:`ReplayableOptimizer` adds what the training step needs to replay a
step from a captured CUDA graph.

Example::

    class Plain(Optimizer):
        name = "plain"
        def __init__(self, net): self.net = net
        def step(self, lr): self.net.params -= lr * self.net.grads
        def state_dict(self): return {}
        def load_state_dict(self, state): pass
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Optimizer(ABC):
    """Base class of every optimizer (see the module docstring)."""

    name = "optimizer"
    #: the parallel method's scale on an L2 term (1/J where J jobs' models are
    #: averaged at J times the rate), set by :meth:`set_l2_factor`
    l2_factor = 1.0
    #: What the whole-model max-change is scaled by (Kaldi's first iteration takes
    #: it over sqrt(2)), set by :meth:`set_max_change_factor`
    max_change_factor = 1.0

    @abstractmethod
    def step(self, lr) -> None:
        """Update the network's parameters from its gradients at rate ``lr``."""

    @abstractmethod
    def state_dict(self) -> dict:
        """What continues this optimizer exactly: host arrays, numbers, nested dicts."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s result."""

    def skipped_steps(self):
        """Steps skipped so far because their change was not finite: an int, or on a
        device a one-element array, read only when the trainer logs."""
        return 0

    # -- what strategies may touch ---------------------------------------------------
    def momentum_buffer(self):
        """The flat per-parameter buffer that model averaging may average too, or None."""
        return None

    def clear_momentum(self) -> None:
        """Forget accumulated momentum (after a block synchronisation)."""
        buffer = self.momentum_buffer()
        if buffer is not None:
            buffer[...] = 0

    def after_average(self) -> None:
        """Called right after the ranks' models were averaged."""

    def close(self) -> None:
        """Stop the threads this optimizer started (the trainer's run has ended)."""

    def restrict_to(self, start: int, stop: int) -> None:
        """From now on update only ``params[start:stop]``, a run of whole layers (a
        parameter server's slice of the model), reading no gradient outside it."""
        raise NotImplementedError(f"{self.name}: cannot update a slice of the model")

    def set_l2_factor(self, factor: float) -> None:
        """Scale the L2 term (if any) by ``factor`` from the next step on."""
        self.l2_factor = float(factor)

    def set_max_change_factor(self, factor: float) -> None:
        """Scale the whole-model max-change (if any) by ``factor`` from the next step on."""
        self.max_change_factor = float(factor)


class ReplayableOptimizer(Optimizer):
    """An optimizer whose steps a captured CUDA graph may replay.

    The training step asks :meth:`static_step_ahead` before each step; when it
    says yes, the rate goes in through :meth:`load_learning_rate`, the step is
    ``step(None)`` (captured once, then replayed), and a replay's host side is
    :meth:`count_replayed_step`.

    Example::

        if opt.static_step_ahead():
            opt.load_learning_rate(lr)
            graph.launch()
            opt.count_replayed_step()
    """

    @abstractmethod
    def static_step_ahead(self) -> bool:
        """Whether the next step is fixed device work on fixed buffers (replayable)."""

    @abstractmethod
    def load_learning_rate(self, lr: float) -> None:
        """Put ``lr`` where ``step(None)`` reads it on the device."""

    @abstractmethod
    def host_step_state(self) -> list:
        """The host counters one step advances (to undo a failed capture)."""

    @abstractmethod
    def restore_host_step_state(self, state: list) -> None:
        """Put back what :meth:`host_step_state` returned."""

    @abstractmethod
    def count_replayed_step(self) -> None:
        """The host side of a step whose device work was replayed."""

    def graph_key(self) -> tuple:
        """What a captured step depends on besides the minibatch's buffers: the
        addresses of the optimizer's buffers that may move (a reset or a load
        makes new ones), so that a graph on freed memory is never replayed."""
        return ()
