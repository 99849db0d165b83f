"""A feed-forward network whose parameters live in one flat buffer.

``Network.params`` and ``Network.grads`` are 1-D float32 arrays; each layer
holds views into them.  Parallel strategies average ``params`` (or ``grads``)
with one collective, and checkpoints store ``params`` as one dataset.

The network also carries its fixed input transform: global CMVN applied to
unspliced frames, and the splicing context, so a saved model can be applied to
raw features (``export``) without the training corpus.
"""

from __future__ import annotations

import inspect

import numpy as np

from .affine import Affine
from .component import BufferCache, Component
from .loss import SoftmaxCrossEntropy
from .nonlinear import Normalize, PNorm, ReLU, Sigmoid

_KINDS = {cls.kind: cls for cls in (Affine, ReLU, Sigmoid, PNorm, Normalize)}

#: How far from the training features' mean (in their standard deviations, as CMVN
#: leaves them) an input may lie and still be one a trained model scores: a model
#: whose outputs overflow within it is itself the cause (weights no training gives),
#: one that overflows only beyond it meets features far outside what it was trained on.
TRAINED_RANGE = 100.0


def build_component(spec: dict) -> Component:
    """Recreate a component from its ``spec()``."""
    spec = dict(spec)
    kind = spec.pop("kind")
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown component kind {kind!r}; expected one of {sorted(_KINDS)}")
    in_dim, out_dim = spec.pop("in_dim"), spec.pop("out_dim", None)
    options = [name for name, param in inspect.signature(cls).parameters.items()
               if param.kind is param.KEYWORD_ONLY]
    unknown = sorted(set(spec) - set(options))
    if unknown:
        raise ValueError(f"field {unknown[0]!r} is not an option of {kind} (its options: "
                         f"{', '.join(options) or 'none'})")
    if cls in (Affine, PNorm):
        return cls(in_dim, out_dim, **spec)
    if out_dim is not None and out_dim != in_dim:
        # the stored width would be ignored: the file is not what was written
        raise ValueError(f"field 'out_dim' is {out_dim}, but {kind} keeps the width of its "
                         f"input (in_dim {in_dim})")
    return cls(in_dim, **spec)


#: A dimension whose variance is below this share of its mean square is constant
#: but for rounding (float32 holds about 7 digits), and normalising would blow up
#: that noise.  Each dimension is judged by its own values, so that features of
#: any scale (even 1e-20) are normalised, and one dimension of a huge scale (an
#: outlier such as 1e30 in one frame) leaves the others as they are.
RELATIVE_VARIANCE_FLOOR = 1e-12
#: ... and no variance is taken below this, so that 1 / sqrt(var) stays a float32.
ABSOLUTE_VARIANCE_FLOOR = 1e-60


def constant_dimensions(mean, var) -> np.ndarray:
    """Which feature dimensions are constant (bool per dimension).

    Example::

        constant_dimensions([5.0, 0.0, 1.0], [0.0, 0.0, 4.0])     # [True, True, False]
    """
    mean = np.asarray(mean, dtype=np.float64)
    var = np.asarray(var, dtype=np.float64)
    return var <= RELATIVE_VARIANCE_FLOOR * (mean * mean + var)


def floored_variance(mean, var) -> np.ndarray:
    """Per-dimension variances (float64) floored for normalisation.

    A constant dimension (:func:`constant_dimensions`) gets the median variance
    of the others (1 when all are constant): it carries nothing in training,
    and where it varies elsewhere (held-out data, export) it is then scaled like
    a typical dimension instead of by a huge factor.

    Example::

        floored_variance([5.0, 0.0, 1.0], [0.0, 4.0, 9.0])       # [6.5, 4.0, 9.0]
    """
    var = np.asarray(var, dtype=np.float64)
    constant = constant_dimensions(mean, var)
    if constant.any():
        typical = float(np.median(var[~constant])) if not constant.all() else 1.0
        var = np.where(constant, typical, var)
    return np.maximum(var, ABSOLUTE_VARIANCE_FLOOR)


class Network:
    """Layers, flat parameter/gradient buffers, and the input transform.

    Example::

        net = Network([Affine(440, 512), ReLU(512), Affine(512, 120)],
                      feat_dim=40, left_context=5, right_context=5)
        net.init_params(seed=1)
        loss, correct = net.train_step_forward_backward(x, labels)
    """

    def __init__(self, components, *, feat_dim: int, left_context: int = 0,
                 right_context: int = 0, xp=np, dtype="float32"):
        self.components = list(components)
        if not self.components:
            raise ValueError("a network needs at least one component")
        for a, b in zip(self.components, self.components[1:]):
            if a.out_dim != b.in_dim:
                raise ValueError(f"dimension mismatch: {a!r} feeds {b!r}")
        self.feat_dim = int(feat_dim)
        self.left_context, self.right_context = int(left_context), int(right_context)
        expected_in = self.feat_dim * (self.left_context + 1 + self.right_context)
        if self.components[0].in_dim != expected_in:
            raise ValueError(f"first layer takes {self.components[0].in_dim} inputs but "
                             f"feat_dim {feat_dim} with context {left_context}+{right_context} "
                             f"gives {expected_in}")
        self.xp = xp
        self.num_params = sum(c.num_params for c in self.components)
        self.params = xp.zeros(self.num_params, dtype=dtype)
        self.grads = xp.zeros(self.num_params, dtype=dtype)
        self.param_slices = []
        self._param_offsets = []
        self.grad_ready_hook = None
        offset = 0
        for c in self.components:
            n = c.num_params
            self._param_offsets.append(offset)
            if n:
                c.bind(self.params[offset:offset + n], self.grads[offset:offset + n])
                self.param_slices.append((c, slice(offset, offset + n)))
            offset += n
        self.cmvn_mean = xp.zeros(self.feat_dim, dtype=dtype)
        self.cmvn_scale = xp.ones(self.feat_dim, dtype=dtype)
        # {"norm_vars": bool} when the raw features got per-speaker CMVN before
        # cmvn_mean/cmvn_scale (prepare applied it): export must do the same
        self.speaker_cmvn = None
        self.loss = SoftmaxCrossEntropy()
        # training.dropout: a DropoutMasks applied to hidden-layer outputs in
        # forward_backward only (evaluation and saved models never see it)
        self.dropout = None
        self._dropout_in_use = None
        # the components whose output ends a hidden layer (feeds an affine layer)
        self._hidden_ends = {i: n for n, i in enumerate(
            i for i in range(len(self.components) - 1)
            if isinstance(self.components[i + 1], Affine)
            and not isinstance(self.components[i], Affine))}

    # -- structure -------------------------------------------------------------
    @property
    def input_dim(self) -> int:
        return self.components[0].in_dim

    @property
    def num_classes(self) -> int:
        return self.components[-1].out_dim

    @property
    def context(self) -> int:
        return self.left_context + 1 + self.right_context

    def affine_layers(self):
        return [c for c in self.components if isinstance(c, Affine)]

    def specs(self) -> list:
        return [c.spec() for c in self.components]

    # -- parameters ------------------------------------------------------------
    def init_params(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for c in self.components:
            c.init_params(rng, self.xp)

    def set_cmvn(self, mean, var) -> None:
        """Global mean/variance normalisation applied to unspliced frames (the
        variance floored by :func:`floored_variance`)."""
        xp = self.xp
        mean = np.asarray(mean, dtype=np.float64)
        var = floored_variance(mean, var)
        self.cmvn_mean[...] = xp.asarray(mean.astype(np.float32))
        self.cmvn_scale[...] = xp.asarray((1.0 / np.sqrt(var)).astype(np.float32))

    def normalize_frames(self, feats):
        """Apply CMVN in place to a chunk of unspliced frames (T, feat_dim)."""
        feats -= self.cmvn_mean
        feats *= self.cmvn_scale
        return feats

    # -- computation -----------------------------------------------------------
    def first_input_view(self, batch: int):
        """Where the spliced minibatch should be written to avoid a copy
        (a (batch, input_dim) view with a row stride of input_dim + 1), or None."""
        first = self.components[0]
        if isinstance(first, Affine):
            return first.input_view(batch, self.xp)
        return None

    def forward(self, x, *, dropout=None, keep_buffers: bool = True):
        """Logits for the rows of ``x`` (N, input_dim); ``dropout`` (a
        :class:`~mpitrain.nn.dropout.DropoutMasks`) masks hidden-layer outputs.

        The layers keep scratch buffers per row count for the next pass of that
        size.  ``keep_buffers=False``: a row count seen once (the last, shorter
        batch of an utterance); the buffers this pass had to add are released
        after it, so scoring many utterances of different lengths does not grow
        memory with each new length.  The logits stay valid.
        """
        if not keep_buffers:
            caches = self._buffer_caches()
            held = [cache.keys() for cache in caches]
            try:
                return self.forward(x, dropout=dropout)
            finally:
                for cache, keys in zip(caches, held):
                    cache.release_except(keys)
        h = x
        comps = self.components
        masked = dropout is not None and dropout.active
        for i, comp in enumerate(comps):
            layer = self._hidden_ends.get(i)
            if layer is None:
                h = comp.forward(h)
                continue
            into = comps[i + 1].input_view(h.shape[0], self.xp)
            if not masked:
                h = comp.forward(h, out=into)
                continue
            # the component keeps its own output for its backward pass; the
            # next layer gets the masked copy
            y = comp.forward(h)
            mask = dropout.mask(layer, y.shape, self.xp, y.dtype)
            h = self.xp.multiply(y, mask, out=into) if into is not None else y * mask
        return h

    def backward(self, dlogits) -> None:
        """Fill ``grads`` from the derivative of the loss w.r.t. the logits.

        ``grad_ready_hook``, when set, is called as ``hook(offset)`` each time
        the gradients from flat offset ``offset`` to the end are final (layers
        finish last to first), so a strategy can start reducing them while
        earlier layers still compute.
        """
        d = dlogits
        hook = self.grad_ready_hook
        offsets = self._param_offsets
        dropout = self._dropout_in_use
        for i in range(len(self.components) - 1, -1, -1):
            layer = self._hidden_ends.get(i) if dropout is not None else None
            if layer is not None:
                d = dropout.apply(layer, d)
            d = self.components[i].backward(d, need_input_grad=i > 0)
            if hook is not None and self.components[i].num_params:
                hook(offsets[i])

    def forward_backward(self, x, labels, *, into=None, dropout: bool = True):
        """One training pass: returns (summed loss, correct count); fills grads.

        With ``into`` (float64 (2,) on the network's device) the two sums are
        added there and ``into`` is returned, so nothing is read back.
        ``dropout``: apply :attr:`dropout`'s masks when it has any (False for
        gradients of the model as evaluated).
        """
        masks = self.dropout
        dropout = masks if dropout and masks is not None and masks.active else None
        logits = self.forward(x, dropout=dropout)
        result = self.loss.forward(logits, labels, into=into)
        self._dropout_in_use = dropout
        try:
            self.backward(self.loss.backward())
        finally:
            self._dropout_in_use = None
        return result

    def overflow_site(self, x) -> str | None:
        """Where the model itself overflows on the rows ``x`` (normalised, spliced):
        the first component whose output is inf or NaN once ``x`` is clipped to
        +-:data:`TRAINED_RANGE`, in words ("component 3 of 5, Affine(32->32),
        parameters up to 1e+30 in magnitude"); None when the clipped rows score
        finitely, so that only inputs far outside the training range overflow it.
        For the error of a scoring that was not finite (nothing else calls it)."""
        from .loss import log_softmax
        xp = self.xp
        h = xp.clip(xp.nan_to_num(x), -TRAINED_RANGE, TRAINED_RANGE)
        caches = self._buffer_caches()
        held = [cache.keys() for cache in caches]
        try:
            with np.errstate(all="ignore"):
                for i, comp in enumerate(self.components):
                    h = comp.forward(h)
                    if not bool(xp.isfinite(h).all()):
                        params = (f", parameters up to {float(xp.abs(comp.block).max()):.3g} "
                                  "in magnitude" if comp.num_params else "")
                        return (f"component {i + 1} of {len(self.components)}, "
                                f"{comp!r}{params}")
                if not bool(xp.isfinite(log_softmax(h)).all()):
                    return (f"the log-softmax of its last component's outputs (up to "
                            f"{float(xp.abs(h).max()):.3g} in magnitude)")
        finally:
            for cache, keys in zip(caches, held):
                cache.release_except(keys)
        return None

    def _buffer_caches(self) -> list:
        return [c._buffers for c in self.components
                if isinstance(getattr(c, "_buffers", None), BufferCache)]

    def evaluate_batch(self, x, labels, *, into=None, keep_buffers: bool = True):
        """(summed loss, correct count) of a minibatch, or added to ``into``
        (``keep_buffers``: as for :meth:`forward`)."""
        logits = self.forward(x, keep_buffers=keep_buffers)
        return self.loss.forward(logits, labels, need_grad=False, into=into)


def build_network(*, feat_dim: int, num_classes: int, left_context: int, right_context: int,
                  hidden_layers: int, hidden_dim: int, nonlinearity: str = "relu",
                  pnorm_output_dim: int = 0, pnorm_p: float = 2.0, normalize: bool = False,
                  xp=np) -> Network:
    """The standard acoustic-model topology.

    ``[affine -> nonlinearity (-> normalize)] x hidden_layers -> affine`` with a
    zero-initialised output layer, as Kaldi does.  For p-norm, ``hidden_dim`` is
    the affine output and ``pnorm_output_dim`` the group output.

    Example::

        net = build_network(feat_dim=40, num_classes=120, left_context=5,
                            right_context=5, hidden_layers=3, hidden_dim=512)
    """
    if hidden_layers < 0:
        raise ValueError(f"hidden_layers must be >= 0, got {hidden_layers}")
    in_dim = feat_dim * (left_context + 1 + right_context)
    comps = []
    for _ in range(hidden_layers):
        if nonlinearity == "relu":
            comps += [Affine(in_dim, hidden_dim, init_scale=2 ** 0.5), ReLU(hidden_dim)]
            out = hidden_dim
        elif nonlinearity == "sigmoid":
            comps += [Affine(in_dim, hidden_dim, init_scale=1.0), Sigmoid(hidden_dim)]
            out = hidden_dim
        elif nonlinearity == "pnorm":
            out = pnorm_output_dim
            comps += [Affine(in_dim, hidden_dim, init_scale=1.0),
                      PNorm(hidden_dim, out, p=pnorm_p)]
        else:
            raise ValueError(f"unknown nonlinearity {nonlinearity!r}")
        if normalize:
            comps.append(Normalize(out))
        in_dim = out
    comps.append(Affine(in_dim, num_classes, zero_init=True))
    return Network(comps, feat_dim=feat_dim, left_context=left_context,
                   right_context=right_context, xp=xp)
