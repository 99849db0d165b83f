"""Restricted Boltzmann machines trained with one step of contrastive divergence (CD-1).

As in Kaldi nnet1's ``rbm-train-cd1-frmshuff`` and Su & Chen's MPI version of
it.  For a minibatch of B visible rows v0 (B, V), hidden units H::

    h0 = sigmoid(v0 W^T + b)                  hidden probabilities of the data
    hs = [u < h0],  u ~ U[0, 1)                one binary sample of the hidden units
    v1 = hs W + a                             Gaussian visible units: the mean, no noise
    v1 = sigmoid(hs W + a)                    Bernoulli visible units
    h1 = sigmoid(v1 W^T + b)                  hidden probabilities of the reconstruction

    gW = (h0^T v0 - h1^T v1) / B              (eqn:cd1) the CD-1 statistics
    gb = mean(h0 - h1),  ga = mean(v0 - v1)
    delta <- m delta + lr (1 - m) (g - lambda [W, 0, 0])     (eqn:step)
    params <- params + delta

The rate is multiplied by (1 - m) so the effective step stays lr g while the
momentum m ramps up; weight decay lambda acts on W only.  The reconstruction
error reported is sum((v0 - v1)^2), per visible unit once divided by B V.

Gaussian visible units only, before (eqn:step), as Kaldi's ``Rbm::RbmUpdate``
(its guard against weight explosion: a reconstruction wider than the data feeds
back into larger weights)::

    s0 = std(v0),  s1 = std(v1)               one figure each over all B V entries
    if s1 > 2 s0:                             (eqn:guard) instead of the step:
        params <- (s0 / s1) params            W, b and a alike
        delta <- 0,  f <- 0.9 f               the rate becomes f lr from the next step

f (``rate_factor``, 1 at the start) multiplies lr until the caller resets it
(Kaldi sets the rate afresh at each step of the momentum ramp).  The test and
the choice run on the device (no read of s0, s1 on the host); ``fired`` counts
the minibatches it caught.

Storage: one flat float32 buffer ``params`` per RBM, as a
:class:`~mpitrain.nn.network.Network` has, so a parallel strategy averages an
RBM with the one collective it uses for a network.  Its layout is the hidden
layer's affine block ``[W | b]`` (H, V + 1), exactly an
:class:`~mpitrain.nn.affine.Affine` block, then the visible bias a (V,).

Symbols in the code: W ``weight``, b ``hidden_bias``, a ``visible_bias``,
g ``rbm.grads`` (same layout as ``params``), delta ``ContrastiveDivergence.delta``,
m ``momentum``, lr ``learning_rate``, lambda ``weight_decay``, u ``uniforms``,
f ``ContrastiveDivergence.rate_factor``.
"""

from __future__ import annotations

import math

import numpy as np

from ..backend import get_array_module, to_host

VISIBLE_TYPES = ("gaussian", "bernoulli")
#: (eqn:guard) a reconstruction more than this many times as spread as its data
#: is scaled down, and the rate cut by RATE_CUT (Kaldi's figures).
SPREAD_LIMIT = 2.0
RATE_CUT = 0.9


def _sigmoid_(x):
    """sigmoid in place (the input is not needed afterwards)."""
    xp = get_array_module(x)
    xp.negative(x, out=x)
    xp.exp(x, out=x)
    x += 1
    xp.reciprocal(x, out=x)
    return x


def _spread(x):
    """The standard deviation of all entries of ``x``, pooled (a 0-d float64 device
    array; a variance below 0 by rounding counts as 0)."""
    xp = get_array_module(x)
    mean = x.sum(dtype=xp.float64) / x.size
    var = (x * x).sum(dtype=xp.float64) / x.size - mean * mean
    return xp.sqrt(xp.maximum(var, 0.0))


class RBM:
    """One RBM on a flat parameter buffer.

    Example::

        rbm = RBM(440, 1024, visible="gaussian")
        rbm.init_params(seed=1)
        h = rbm.hidden_probabilities(v)          # (B, 1024), what the next layer sees
    """

    def __init__(self, visible_dim: int, hidden_dim: int, *, visible: str = "bernoulli",
                 xp=np, dtype="float32"):
        if visible_dim < 1 or hidden_dim < 1:
            raise ValueError(f"RBM dims must be positive, got {visible_dim}->{hidden_dim}")
        if visible not in VISIBLE_TYPES:
            raise ValueError(f"visible units must be one of {VISIBLE_TYPES}, got {visible!r}")
        self.visible_dim, self.hidden_dim = int(visible_dim), int(hidden_dim)
        self.visible = visible
        self.xp = xp
        self.num_params = self.hidden_dim * (self.visible_dim + 1) + self.visible_dim
        self.params = xp.zeros(self.num_params, dtype=dtype)
        self.grads = xp.zeros(self.num_params, dtype=dtype)
        self.block, self.visible_bias = self._views(self.params)
        self.grad_block, self.grad_visible_bias = self._views(self.grads)

    def _views(self, flat):
        n = self.hidden_dim * (self.visible_dim + 1)
        return flat[:n].reshape(self.hidden_dim, self.visible_dim + 1), flat[n:]

    @property
    def weight(self):
        return self.block[:, :self.visible_dim]

    @property
    def hidden_bias(self):
        return self.block[:, self.visible_dim]

    def init_params(self, seed: int, *, std: float = 0.1) -> None:
        """Weights N(0, std^2) (Kaldi's param_stddev 0.1), biases zero."""
        rng = np.random.default_rng(seed)
        weights = rng.standard_normal((self.hidden_dim, self.visible_dim)) * std
        self.params[...] = 0
        self.weight[...] = self.xp.asarray(weights.astype(np.float32))

    def init_visible_bias_from_mean(self, mean, *, floor: float = 1e-4) -> None:
        """Bernoulli visible units: a = logit of the data's mean activation, so the
        RBM starts out reconstructing the average input (Kaldi's VisibleBiasCmvn)."""
        p = np.clip(np.asarray(mean, dtype=np.float64), floor, 1 - floor)
        self.visible_bias[...] = self.xp.asarray(np.log(p / (1 - p)).astype(np.float32))

    def hidden_probabilities(self, v):
        """sigmoid(v W^T + b) for the rows of ``v`` (B, V)."""
        h = v @ self.weight.T
        h += self.hidden_bias
        return _sigmoid_(h)

    def reconstruct(self, hidden):
        """The visible units' mean given hidden states (B, H)."""
        v = hidden @ self.weight
        v += self.visible_bias
        return v if self.visible == "gaussian" else _sigmoid_(v)

    def statistics_(self, v0, uniforms, *, spreads: bool = False):
        """Fill ``grads`` with the CD-1 statistics (eqn:cd1) of the minibatch ``v0``
        (B, V), sampling the hidden units with ``uniforms`` (B, H) in [0, 1); returns
        the summed squared reconstruction error as a 0-d device array (with
        ``spreads``, and the standard deviations of v0 and v1 as well, (eqn:guard))."""
        xp = self.xp
        batch = v0.shape[0]
        h0 = self.hidden_probabilities(v0)
        sample = (uniforms < h0).astype(v0.dtype)
        v1 = self.reconstruct(sample)
        h1 = self.hidden_probabilities(v1)
        scale = 1.0 / batch
        gw = self.grad_block[:, :self.visible_dim]
        gw[...] = h0.T @ v0     # a strided view: CuPy's matmul cannot write into it
        gw -= h1.T @ v1
        gw *= scale
        self.grad_block[:, self.visible_dim] = (h0.sum(axis=0) - h1.sum(axis=0)) * scale
        diff = v0 - v1
        self.grad_visible_bias[...] = diff.sum(axis=0) * scale
        sq_err = (diff * diff).sum(dtype=xp.float64)
        return (sq_err, _spread(v0), _spread(v1)) if spreads else sq_err

    def spec(self) -> dict:
        return {"visible": self.visible, "visible_dim": self.visible_dim,
                "hidden_dim": self.hidden_dim}


class ContrastiveDivergence:
    """CD-1 training of one RBM with momentum and weight decay (eqn:step).

    Offers what a parallel strategy asks of an optimizer
    (``momentum_buffer``, ``after_average``), so
    :class:`~mpitrain.parallel.model_averaging.ModelAveraging` averages RBMs as
    it averages networks.

    Example::

        cd = ContrastiveDivergence(rbm, weight_decay=0.0002)
        sq_err = cd.step(v0, uniforms, learning_rate=0.01, momentum=0.5)
    """

    name = "cd1"

    def __init__(self, rbm: RBM, *, weight_decay: float = 0.0002):
        if weight_decay < 0 or not math.isfinite(weight_decay):
            raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
        self.rbm, self.weight_decay = rbm, float(weight_decay)
        xp = rbm.xp
        self.delta = xp.zeros_like(rbm.params)
        # (eqn:guard) on the device, so that no step waits for a read of them
        self.rate_factor = xp.ones((), dtype=xp.float64)
        self.fired = xp.zeros((), dtype=xp.float64)

    def step(self, v0, uniforms, *, learning_rate: float, momentum: float):
        """One CD-1 update on the minibatch ``v0`` (or, Gaussian visible units, the
        guard's scaling instead: eqn:guard); returns its summed squared
        reconstruction error (a 0-d device array, read when it is logged)."""
        rbm, xp = self.rbm, self.rbm.xp
        gaussian = rbm.visible == "gaussian"
        if gaussian:
            sq_err, data_spread, recon_spread = rbm.statistics_(v0, uniforms, spreads=True)
        else:
            sq_err = rbm.statistics_(v0, uniforms)
        if self.weight_decay:
            rbm.grad_block[:, :rbm.visible_dim] -= self.weight_decay * rbm.weight
        self.delta *= momentum
        if not gaussian:
            self.delta += (learning_rate * (1.0 - momentum)) * rbm.grads
            rbm.params += self.delta
            return sq_err
        # a device-side choice: when the guard fires, keep 0 drops the step and
        # resets the momentum, scale shrinks the parameters; else both are 1 exactly
        fired = recon_spread > SPREAD_LIMIT * data_spread
        keep = (~fired).astype(rbm.params.dtype)
        scale = xp.where(fired, data_spread / xp.maximum(recon_spread, 1e-30), 1.0)
        rate = (self.rate_factor * (learning_rate * (1.0 - momentum))).astype(rbm.params.dtype)
        self.delta += rate * rbm.grads
        self.delta *= keep
        rbm.params *= scale.astype(rbm.params.dtype)
        rbm.params += self.delta
        self.rate_factor *= xp.where(fired, RATE_CUT, 1.0)
        self.fired += fired
        return sq_err

    def reset_rate_factor(self) -> None:
        """The full rate again (Kaldi: at each step of the momentum ramp)."""
        self.rate_factor[...] = 1.0

    # -- what a strategy and a checkpoint need ---------------------------------------
    def momentum_buffer(self):
        return self.delta

    def after_average(self) -> None:
        """Nothing to reset: CD-1 keeps no statistics beyond its momentum."""

    def state_dict(self) -> dict:
        return {"delta": to_host(self.delta).copy(),
                "rate_factor": float(to_host(self.rate_factor))}

    def load_state_dict(self, state: dict) -> None:
        """A state without ``rate_factor`` (written before the guard) gives 1."""
        delta = np.asarray(state["delta"], dtype=np.float32)
        if delta.shape != self.delta.shape:
            raise ValueError(f"momentum buffer has shape {delta.shape}; the RBM needs "
                             f"{self.delta.shape}")
        factor = state.get("rate_factor", 1.0)
        if not valid_rate_factor(factor):
            raise ValueError(f"rate_factor is {factor!r}; expected a number in (0, 1]")
        self.delta[...] = self.rbm.xp.asarray(delta)
        self.rate_factor[...] = float(factor)


def valid_rate_factor(value) -> bool:
    """Whether ``value`` can be a :attr:`ContrastiveDivergence.rate_factor`: a
    number in (0, 1] (the guard only ever cuts it)."""
    return isinstance(value, (int, float, np.integer, np.floating)) \
        and not isinstance(value, (bool, np.bool_)) and 0 < value <= 1


#: A stack's ``speaker_cmvn`` when its file did not record it.
UNRECORDED = "unrecorded"


class RBMStack:
    """RBMs trained layer by layer, with the input transform of their first layer.

    Example::

        stack = RBMStack([rbm1, rbm2], feat_dim=40, left_context=5, right_context=5,
                         cmvn_mean=mean, cmvn_scale=scale)
        h = stack.propagate(v)          # the top layer's hidden probabilities
    """

    def __init__(self, rbms, *, feat_dim: int, left_context: int, right_context: int,
                 cmvn_mean, cmvn_scale, speaker_cmvn=UNRECORDED):
        self.rbms = list(rbms)
        #: the corpus's per-speaker CMVN (None: none; UNRECORDED: a file older
        #: than this record)
        self.speaker_cmvn = speaker_cmvn
        self.feat_dim = int(feat_dim)
        self.left_context, self.right_context = int(left_context), int(right_context)
        self.cmvn_mean = np.asarray(cmvn_mean, dtype=np.float32)
        self.cmvn_scale = np.asarray(cmvn_scale, dtype=np.float32)
        dim = self.feat_dim * (self.left_context + 1 + self.right_context)
        for i, rbm in enumerate(self.rbms):
            if rbm.visible_dim != dim:
                raise ValueError(f"RBM {i} has {rbm.visible_dim} visible units; the layer "
                                 f"below gives {dim}")
            dim = rbm.hidden_dim

    @property
    def input_dim(self) -> int:
        return self.feat_dim * (self.left_context + 1 + self.right_context)

    def propagate(self, v, *, layers: int | None = None):
        """Hidden probabilities of the first ``layers`` RBMs (all by default)."""
        for rbm in self.rbms[:len(self.rbms) if layers is None else layers]:
            v = rbm.hidden_probabilities(v)
        return v
