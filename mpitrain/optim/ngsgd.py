"""NG-SGD: SGD whose affine-layer gradients are natural-gradient preconditioned.

Each affine layer gets two preconditioners, one for its input rows ``[x, 1]``
and one for its output derivatives (see natural-gradient.md and
``natural_gradient.py``).  The layer forms its gradient block from the
preconditioned rows during backward, so this optimizer's step is SGD's step
(max-change included) applied to that gradient, and every parallel strategy
works unchanged: each rank preconditions its own rows.
"""

from __future__ import annotations

import numpy as np

from ..state_fields import count
from ..words import shown
from .natural_gradient import JointFisherUpdates, OnlineNaturalGradient, SimpleNaturalGradient
from .sgd import SGD


class NaturalGradientSGD(SGD):
    """Example::

        opt = NaturalGradientSGD(net, rank_in=20, rank_out=80, update_period=4,
                                 num_samples_history=2000.0, alpha=4.0)
    """

    name = "ngsgd"

    def __init__(self, net, *, variant: str = "online", rank_in: int = 20, rank_out: int = 80,
                 update_period: int = 4, num_samples_history: float = 2000.0,
                 alpha: float = 4.0, reset_on_average: bool = False,
                 delayed_updates: bool = False, plan_threads: int = 0, **sgd_options):
        super().__init__(net, **sgd_options)
        # Kaldi starts every job after an average from fresh Fisher estimates; its
        # jobs are hundreds of minibatches long.  Averaging every few minibatches,
        # a fresh start keeps every step in the estimate's costly start-up phase.
        self.reset_on_average = bool(reset_on_average)
        if variant not in ("online", "simple"):
            raise ValueError(f"variant must be 'online' or 'simple', got {variant!r}")
        self.variant = variant
        self.preconditioners = {}
        self._dims = {}             # the number of columns each preconditioner sees
        for i, layer in enumerate(net.affine_layers()):
            if variant == "online":
                # Kaldi's caps: at most half the dimension (the input side has I + 1 columns)
                r_in = max(1, min(rank_in, (layer.in_dim + 1) // 2))
                r_out = max(1, min(rank_out, (layer.out_dim + 1) // 2))
                options = dict(update_period=update_period,
                               num_samples_history=num_samples_history, alpha=alpha,
                               delayed_updates=delayed_updates)
                p_in = OnlineNaturalGradient(rank=r_in, **options)
                p_out = OnlineNaturalGradient(rank=r_out, **options)
            else:
                p_in, p_out = SimpleNaturalGradient(alpha=alpha), SimpleNaturalGradient(alpha=alpha)
            layer.set_preconditioners(p_in, p_out)
            self.preconditioners[f"layer{i}_in"] = p_in
            self.preconditioners[f"layer{i}_out"] = p_out
            self._dims[f"layer{i}_in"], self._dims[f"layer{i}_out"] = \
                layer.in_dim + 1, layer.out_dim
        # every side updates in the same minibatches: their host parts run together,
        # or each on a worker thread while the GPU goes on
        self.joint_updates = JointFisherUpdates(self.preconditioners.values(),
                                                threads=plan_threads)

    def static_step_ahead(self) -> bool:
        return super().static_step_ahead() and self.variant == "online" and all(
            p.static_call_ahead() for p in self.preconditioners.values())

    def graph_key(self) -> tuple:
        return super().graph_key() + tuple(p.graph_buffers()
                                           for p in self.preconditioners.values())

    def host_step_state(self) -> list:
        return super().host_step_state() + [p.t for p in self.preconditioners.values()]

    def restore_host_step_state(self, state: list) -> None:
        super().restore_host_step_state(state[:1])
        for p, t in zip(self.preconditioners.values(), state[1:]):
            p.t = t

    def count_replayed_step(self) -> None:
        super().count_replayed_step()
        for p in self.preconditioners.values():
            p.count_replayed_call()

    def reset_preconditioners(self) -> None:
        """Fresh Fisher estimates, as each Kaldi job starts after an average."""
        for p in self.preconditioners.values():
            p.reset()

    def after_average(self) -> None:
        if self.reset_on_average:
            self.reset_preconditioners()

    def close(self) -> None:
        self.joint_updates.close()

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["preconditioners"] = {k: p.state_dict() for k, p in self.preconditioners.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("preconditioners", {})
        # every side is checked before any is loaded: a refused state (which the
        # trainer may answer by starting afresh) must leave no side half loaded
        if not isinstance(saved, dict):
            raise ValueError("optimizer state: 'preconditioners' is not a group")
        for key, p in self.preconditioners.items():
            if not isinstance(saved.get(key), dict):
                raise ValueError(f"optimizer state has no preconditioner '{key}'")
            w = saved[key].get("W", np.zeros((0, 0)))
            if not isinstance(w, np.ndarray):
                raise ValueError(f"optimizer state: preconditioner '{key}': field 'W' is "
                                 f"{shown(w)}, not an array")
            if w.size and (w.ndim != 2 or w.shape[1] != self._dims[key]):
                raise ValueError(f"optimizer state: preconditioner '{key}' has W of shape "
                                 f"{w.shape}; its layer gives rows of {self._dims[key]} columns")
            # a state of another rank would be taken as it is and keep that rank
            # until the next reset: the configured rank would be ignored unsaid
            rank = count(saved[key], "rank", f"optimizer state: preconditioner '{key}'",
                         default=0)
            if w.size and isinstance(p, OnlineNaturalGradient) and rank != p.rank:
                raise ValueError(f"optimizer state: preconditioner '{key}' has rank {rank}; "
                                 f"the settings give it rank {p.rank} "
                                 "(optimizer.ngsgd.rank_in, rank_out)")
        # the sides first: one that fails further on (a damaged pending update) leaves
        # the momentum and counters as a fresh optimizer's, as the refusal says
        try:
            for key, p in self.preconditioners.items():
                try:
                    p.load_state_dict(saved[key])
                except ValueError as exc:
                    raise ValueError(f"optimizer state: preconditioner '{key}': {exc}") from None
            super().load_state_dict(state)
        except ValueError:
            self.reset_preconditioners()
            raise
