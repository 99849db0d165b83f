"""``adapt``: You & Xu's ASGD-adapt, per-parameter Adagrad with limited memory.

Rule (the paper's eq. 2, with gamma = ``optimizer.initial_learning_rate``,
K = ``optimizer.adapt_k`` and d = ``optimizer.adapt_decay``), per parameter
j and step t, on the minibatch's summed gradient g::

    G_j(t) = d G_j(t-1) + g_j(t)^2
    step_j = gamma / sqrt(K + G_j(t)) * g_j(t)

"Limited memory": the paper sums g^2 over s = tau..t with tau = t, i.e. only
the current gradient counts (d = 0, the default: step = gamma g / sqrt(K + g^2),
at most gamma per parameter).  d > 0 keeps a decaying sum instead (memory of
about 1 / (1 - d) steps), kept in checkpoints.  :meth:`scale_` turns the
gradient buffer into ``g / sqrt(K + G)`` in place; SGD then takes its step
at rate gamma on it, so momentum and max-change act on the resulting change.

On a device this is plain array expressions on the flat buffers (no kernel of
its own) and reads nothing back.  A non-finite gradient element is left out
of G (SGD skips that step anyway), so one bad minibatch does not poison the
memory.

Example::

    scaling = LimitedMemoryAdagrad(net.params, k=1.0, decay=0.0)
    opt = SGD(net, gradient_scaling=scaling)
    opt.step(0.008)         # params -= 0.008 * g / sqrt(1 + g^2), then max-change
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..state_fields import float32_buffer


class LimitedMemoryAdagrad:
    """Per-parameter scaling of the gradient buffer (see the module docstring)."""

    def __init__(self, like, *, k: float = 1.0, decay: float = 0.0):
        # K is added in float32: below its smallest normal number it is 0, and a
        # parameter without gradient would get 0 / 0
        if not k >= np.finfo(np.float32).tiny or not 0.0 <= decay < 1.0:
            raise ValueError(f"adapt: need k >= {np.finfo(np.float32).tiny:g} (float32's "
                             f"smallest normal number) and decay in [0, 1), got {k}, {decay}")
        self.k, self.decay = float(k), float(decay)
        xp = backend.get_array_module(like)
        self.xp = xp
        # G (only with memory) and a scratch buffer for g^2 and sqrt(K + G)
        self.sum = xp.zeros_like(like) if self.decay > 0 else None
        self._scratch = xp.empty_like(like)

    def scale_(self, grads, part=slice(None)) -> None:
        """``grads <- grads / sqrt(K + G)`` after adding ``grads^2`` to G; only
        ``grads[part]`` and its part of G when ``part`` is given (a slice)."""
        xp = self.xp
        grads = grads[part]
        sq = xp.multiply(grads, grads, out=self._scratch[part])
        if self.sum is None:
            denom = sq
        else:
            memory = self.sum[part]
            xp.copyto(sq, np.float32(0.0), where=~xp.isfinite(sq))
            memory *= np.float32(self.decay)
            memory += sq
            xp.copyto(sq, memory)
            denom = sq
        denom += np.float32(self.k)
        xp.sqrt(denom, out=denom)
        grads /= denom

    def state_dict(self) -> dict:
        if self.sum is None:
            return {}
        return {"sum": np.array(backend.to_host(self.sum))}

    def check_state(self, state: dict):
        """The memory G of a saved state, checked (None without memory): G sums squared
        float32 gradients, so it is >= 0 and, like any float32, finite."""
        if self.sum is None:
            return None
        if not isinstance(state, dict) or "sum" not in state:
            raise ValueError("optimizer state has no 'adapt/sum' (adapt_decay > 0)")
        return float32_buffer(state["sum"], tuple(self.sum.shape),
                              "optimizer state: field 'adapt/sum'", low=0.0)

    def load_state_dict(self, state: dict) -> None:
        saved = self.check_state(state)
        if saved is not None:
            self.sum[...] = backend.to_device(saved, self.xp)
