"""SGD with Kaldi nnet3's per-layer and global max-change, and momentum.

The step works on the network's flat buffers.  With the summed-loss gradient
``g`` the proposed change is ``Delta = -lr g`` (accumulated into a momentum
buffer when momentum > 0).  Per layer c with norm n_c = ||Delta_c|| the scale
is k_c = min(1, m_c / (n_c (1 - momentum))); the whole-model norm
n = (1 - momentum) sqrt(sum k_c^2 n_c^2) is capped at ``max_change``.  A
non-finite norm skips the step (the norms are summed in float64: a finite
change too large for float32's squares is clipped, not skipped).  This is
what keeps large learning rates and model averaging stable, as in Kaldi.

On the host the norms are read and the scales computed in Python; on a GPU
the same rule runs in three kernels (``kernels.max_change_step_``) and
nothing is read back, so the host never waits for the GPU during a step.

With ``gradient_scaling`` (``optimizer.schedule: adapt``, ``adapt.py``) the
gradient is first scaled per parameter, and ``g`` above is the scaled one.

nnet2's max-change-per-sample (``max_change_per_sample`` m, Su & Chen's
recipes: 0.075), before everything else: each affine layer's backward sums
``tau_c = g_in g_out sum_i ||x_i|| ||g_i||`` over its (preconditioned) rows, an
upper bound on its step's norm per unit rate; where ``lr tau_c > m B`` (B the
frames of the minibatch) the layer's gradient is scaled by ``m B / (lr tau_c)``.
On a device the scales stay on the device.

L2 regularization (Kaldi nnet3's ``l2-regularize``): the objective adds
``l2_c ||w_c||^2`` per frame for each layer c, so a gradient summed over B
frames gains ``2 l2_c B w_c`` (after the natural gradient, which
preconditions only the data term, and after max-change-per-sample, which
bounds only the data term's step; before ``gradient_scaling`` and
max-change, as in Kaldi).  The rate then shrinks the weights by ``2 lr l2_c B`` per step.
Strategies average gradients or models, so the term is counted once however
many ranks there are; where a method trains at J times the rate (Kaldi's
averaging of J jobs) it scales the term by 1/J (``set_l2_factor``), as
Kaldi's ``l2_regularize_factor`` does.

The order in a step: max-change-per-sample, the L2 term, ``gradient_scaling``,
max-change and momentum.

Symbols in the code: g is ``net.grads``, Delta is ``delta`` (the momentum
buffer; ``grads`` itself without momentum), m_c is ``layer_max_change[c]``,
``max_change`` the whole-model cap (times ``max_change_factor``), k_c times
(1 - momentum) the scales of :meth:`SGD._scales`, tau_c an affine layer's
``step_bound``, ``2 l2_c B`` the coefficients in ``l2_terms``.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..backend import to_host
from ..state_fields import count, float32_buffer
from . import kernels
from .base import ReplayableOptimizer


class SGD(ReplayableOptimizer):
    """Plain SGD on a :class:`~mpitrain.nn.network.Network`.

    Example::

        opt = SGD(net, momentum=0.0, max_change_per_layer=0.75,
                  max_change_output=1.5, max_change=2.0)
        net.forward_backward(x, labels)
        opt.step(lr=0.002)
    """

    name = "sgd"

    def __init__(self, net, *, momentum: float = 0.0, max_change_per_layer: float = 0.75,
                 max_change_output: float = 1.5, max_change: float = 2.0,
                 gradient_scaling=None, l2_regularize: float = 0.0,
                 l2_regularize_output: float = 0.0, minibatch: int = 0,
                 max_change_per_sample: float = 0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if min(max_change_per_layer, max_change_output, max_change) < 0:
            raise ValueError("max-change values must be >= 0 (0 disables)")
        self.net = net
        # per-parameter scaling of g before the step (adapt.LimitedMemoryAdagrad), or None
        self.gradient_scaling = gradient_scaling
        self.momentum = float(momentum)
        self.max_change = float(max_change)
        slices = [s for _, s in net.param_slices]
        self.slices = slices
        last = len(slices) - 1
        self.layer_max_change = [max_change_output if i == last else max_change_per_layer
                                 for i in range(len(slices))]
        xp = net.xp
        if min(l2_regularize, l2_regularize_output) < 0:
            raise ValueError("l2_regularize values must be >= 0")
        if (l2_regularize or l2_regularize_output) and minibatch < 1:
            raise ValueError("L2 regularization needs the minibatch size (frames per gradient)")
        # (layer slice, 2 l2_c B) for each regularized layer; scratch holds l2 terms
        self.l2_terms = [(sl, 2.0 * l2 * minibatch) for sl, l2 in zip(
            slices, [l2_regularize_output if i == last else l2_regularize
                     for i in range(len(slices))]) if l2 > 0]
        self._l2_scratch = xp.empty_like(net.params) if self.l2_terms else None
        if max_change_per_sample < 0:
            raise ValueError("max_change_per_sample must be >= 0 (0 disables)")
        if max_change_per_sample and minibatch < 1:
            raise ValueError("max-change-per-sample needs the minibatch size (frames per "
                             "gradient)")
        self.max_change_per_sample = float(max_change_per_sample)
        self.minibatch = int(minibatch)
        # the affine layers whose steps it limits: (index into slices, layer)
        affine = [(i, layer) for i, (layer, _) in enumerate(net.param_slices)
                  if getattr(layer, "kind", "") == "affine"]
        self._bounded = affine if self.max_change_per_sample else []
        for _, layer in affine:
            layer.track_step_bound = bool(self.max_change_per_sample)
        self.delta = xp.zeros_like(net.params) if self.momentum > 0 else None
        self._calls = 0
        # On the host: plain numbers.  On a device: buffers the kernels update.
        self._device = None if xp is np else kernels.MaxChangeState(
            xp, [(sl.start, sl.stop) for sl in slices], self.layer_max_change)
        self._skipped = 0
        self._last_scales = [1.0] * len(slices)
        # what a step changes: all of the buffer, or a run of whole layers (restrict_to)
        self.span = slice(0, net.num_params)
        self.active = list(range(len(slices)))

    # -- counters (read from the device only when asked) ---------------------------
    @property
    def num_skipped(self) -> int:
        """Steps skipped because a change was not finite."""
        if self._device is not None:
            return int(to_host(self._device.skipped)[0])
        return self._skipped

    def skipped_steps(self):
        return self._device.skipped if self._device is not None else self._skipped

    @property
    def num_steps(self) -> int:
        """Steps taken (calls to :meth:`step` that were not skipped)."""
        return self._calls - self.num_skipped

    @property
    def last_scales(self) -> list:
        """Each layer's factor on ``-lr g`` in the last step (``q k_c``, shrunk by the
        global max-change; 0 for every layer when the step was skipped)."""
        if self._device is not None:
            return [float(v) for v in to_host(self._device.scales)]
        return list(self._last_scales)

    # -- the update ------------------------------------------------------------
    def step(self, lr) -> None:
        """One update at rate ``lr`` (on a device, None: the rate given to
        :meth:`load_learning_rate`, as a captured CUDA graph needs)."""
        self._calls += 1
        if self._bounded:
            self._limit_per_sample(lr)
        if self.l2_terms:
            self._add_l2_gradient()
        if self.gradient_scaling is not None:
            self.gradient_scaling.scale_(self.net.grads, self.span)
        if self._device is not None:
            kernels.max_change_step_(self.net.params, self.net.grads, self.delta, lr=lr,
                                     momentum=self.momentum,
                                     max_change=self.max_change * self.max_change_factor,
                                     state=self._device)
            return
        net, xp, span = self.net, self.net.xp, self.span
        grads = net.grads
        # grads becomes -lr * g in place: it is scratch until the next backward.
        grads[span] *= -lr
        if self.delta is None:
            delta = grads
        else:
            self.delta[span] += grads[span]
            delta = self.delta
        norms = self._block_norms(delta)
        q = 1.0 - self.momentum
        scales = self._scales(norms, q)
        if scales is None:
            self._skipped += 1
            self._last_scales = [0.0] * len(self.slices)     # nothing applied (as on a device)
            if self.delta is not None:
                self.delta[span] = 0
            return
        self._last_scales = scales
        params = net.params
        if self.delta is None:
            if all(s == 1.0 for s in scales):
                params[span] += delta[span]
            else:
                for i in self.active:
                    sl = self.slices[i]
                    block = delta[sl]
                    block *= scales[i]
                    params[sl] += block
        else:
            for i in self.active:
                sl = self.slices[i]
                # grads is free now: use it as the temporary for s * delta.
                xp.multiply(delta[sl], scales[i], out=grads[sl])
                params[sl] += grads[sl]
            self.delta[span] *= self.momentum

    def _limit_per_sample(self, lr) -> None:
        """nnet2's max-change-per-sample: layer c's gradient times
        min(1, m B / (lr tau_c)), tau_c from its backward (module docstring)."""
        grads, xp = self.net.grads, self.net.xp
        limit = self.max_change_per_sample * self.minibatch
        active = set(self.active)
        for i, layer in self._bounded:
            bound = layer.step_bound
            if i not in active or bound is None:
                continue
            block = grads[self.slices[i]]
            if xp is np:
                tau = lr * float(bound)
                if tau > limit:                 # (NaN: left to max-change's check)
                    block *= limit / tau
            else:
                # on the device, read nothing back (a bound of 0, a layer whose
                # gradient is 0, is floored so that it scales by 1; NaN stays NaN)
                block *= xp.minimum(1.0, limit / xp.maximum(lr * bound, limit * 1e-30))

    def _add_l2_gradient(self) -> None:
        """g_c += 2 l2_c B w_c (times :attr:`l2_factor`), without temporaries (a
        captured graph may replay it; it is captured anew when the factor changes)."""
        params, grads, scratch, xp = self.net.params, self.net.grads, self._l2_scratch, \
            self.net.xp
        for sl, coefficient in self.l2_terms:
            xp.multiply(params[sl], params.dtype.type(coefficient * self.l2_factor),
                        out=scratch[sl])
            grads[sl] += scratch[sl]

    def _block_norms(self, delta):
        """Each layer's ||delta_c|| (float64); 0 for a layer outside :attr:`span`."""
        xp = self.net.xp
        with np.errstate(over="ignore"):
            sq = xp.stack([xp.dot(delta[self.slices[i]], delta[self.slices[i]])
                           for i in self.active])
        norms = np.zeros(len(self.slices))
        norms[self.active] = np.sqrt(to_host(sq).astype(np.float64))
        for i in self.active:
            if norms[i] == math.inf:
                # the float32 sum of squares overflows from a norm of ~1.8e19 on:
                # a finite change is clipped, not skipped (as the device sums in float64)
                block = delta[self.slices[i]].astype(np.float64)
                norms[i] = math.sqrt(float(np.dot(block, block)))
        return norms

    def _scales(self, norms, q):
        """Per-layer scale factors q * k_c, or None when the step must be skipped."""
        if not np.all(np.isfinite(norms)):
            return None
        k = np.ones_like(norms)
        for i, (n, m) in enumerate(zip(norms, self.layer_max_change)):
            if m > 0 and n * q > m:
                k[i] = m / (n * q)
        total = q * math.sqrt(float(np.sum((k * norms) ** 2)))
        limit = self.max_change * self.max_change_factor
        if limit > 0 and total > limit:
            q = q * limit / total
        return [float(q * ki) for ki in k]

    def momentum_buffer(self):
        return self.delta

    def restrict_to(self, start: int, stop: int) -> None:
        """From now on a step changes only ``params[start:stop]``, a run of whole
        layers (a parameter server's slice of the model).  The gradient outside it
        is not read; the parameters, momentum and ``adapt`` memory outside it are
        left as they are; a layer outside counts as unchanged (norm 0) in the
        whole-model max-change, as with a zero gradient there, and gets no L2 term.
        Inside, the step is the unrestricted step's, bit for bit."""
        start, stop = int(start), int(stop)
        inside = [i for i, sl in enumerate(self.slices) if start <= sl.start and sl.stop <= stop]
        if not inside or self.slices[inside[0]].start != start \
                or self.slices[inside[-1]].stop != stop:
            raise ValueError(f"{self.name}: cannot step parameters {start}..{stop}: a slice "
                             "of the model must begin and end at layer boundaries")
        self.span, self.active = slice(start, stop), inside
        self.l2_terms = [(sl, c) for sl, c in self.l2_terms
                         if start <= sl.start and sl.stop <= stop]
        if self._device is not None:
            self._device.restrict(inside)

    # -- CUDA graphs: steps whose device work is fixed ---------------------------
    def static_step_ahead(self) -> bool:
        """Whether the next :meth:`step` (with the backward pass before it) is fixed
        device work with fixed buffers, which a captured CUDA graph may replay."""
        # adapt's and max-change-per-sample's array expressions allocate
        # temporaries: not captured in a graph
        return self._device is not None and backend.fused_kernels(self.net.xp) \
            and self.gradient_scaling is None and not self._bounded

    def load_learning_rate(self, lr: float) -> None:
        """Put ``lr`` where the device step reads it (before a graph replay)."""
        self._device.neg_lr.fill(-lr)

    def host_step_state(self) -> list:
        """The host counters one step advances (to undo a failed capture)."""
        return [self._calls]

    def restore_host_step_state(self, state: list) -> None:
        self._calls = state[0]

    def count_replayed_step(self) -> None:
        """The host side of a step whose device work was replayed from a graph."""
        self._calls += 1

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"num_steps": self.num_steps, "num_skipped": self.num_skipped}
        if self.delta is not None:
            state["delta"] = to_host(self.delta)
        if self.gradient_scaling is not None:
            state["adapt"] = self.gradient_scaling.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        counts = {key: count(state, key, "optimizer state", default=0)
                  for key in ("num_skipped", "num_steps")}
        delta = None
        if self.delta is not None:
            if "delta" not in state:
                raise ValueError("optimizer state has no 'delta' (momentum) buffer")
            delta = float32_buffer(state["delta"], tuple(self.delta.shape),
                                   "optimizer state: field 'delta' (momentum)")
        adapt = state.get("adapt", {})
        if self.gradient_scaling is not None:
            self.gradient_scaling.check_state(adapt)
        skipped = counts["num_skipped"]
        self._calls = counts["num_steps"] + skipped
        if self._device is not None:
            self._device.skipped[...] = skipped
        else:
            self._skipped = skipped
        if delta is not None:
            self.delta[...] = backend.to_device(delta, self.net.xp)
        if self.gradient_scaling is not None:
            self.gradient_scaling.load_state_dict(adapt)
