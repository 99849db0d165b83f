"""The SGD step against an independent float64 reference of its rules, over
several steps on small random layers.

The reference is written from the rule texts, not from the optimizer's code:
nnet3's max-change, momentum and non-finite skip, and nnet2's
max-change-per-sample (shared natural-gradient spec, section 2); Kaldi
nnet3's ``l2-regularize`` (``ApplyL2Regularization``: the change gains
``-2 l2 N lr factor theta`` per step, N the minibatch's frames) and
``l2_regularize_factor`` 1/J; adapt's per-parameter scaling (user guide,
``optimizer.schedule: adapt``); the first iteration's M/sqrt(2) and the rate
J lr of the ``kaldi`` method (spec section 3).  Gradients are random blocks
of chosen norms, so that steps land on both sides of every limit, well away
from its edge (a scale is a min(), not smooth there).

Tolerances: the optimizer computes in float32 (norms from float32 sums of
at most ~100 squares, scales in float64), the reference in float64 from the
same float32 gradients.  A scale then agrees to a few float32 roundings of
the norm (rtol 2e-5 covers ~100 roundings of 6e-8), and a parameter of size
~1 to a few roundings per step (atol 2e-6 over 6 steps).
"""

import contextlib
import math

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.nn.network import build_network
from mpitrain.optim.adapt import LimitedMemoryAdagrad
from mpitrain.optim.sgd import SGD
from mpitrain.testing import standin_cupy

SCALE_RTOL = 2e-5
PARAM_ATOL = 2e-6
PARAM_RTOL = 1e-5


class Reference:
    """The step of the rule texts in float64 on a list of per-layer blocks."""

    def __init__(self, blocks, *, m, M, momentum, l2, B, mcps, adapt=None):
        self.theta = [b.astype(np.float64) for b in blocks]
        self.delta = [np.zeros_like(b) for b in self.theta]
        self.m, self.M, self.momentum, self.l2, self.B, self.mcps = m, M, momentum, l2, B, mcps
        self.adapt = adapt                                   # (K, decay) or None
        self.G = [np.zeros_like(b) for b in self.theta]
        self.skipped = 0
        self.per_sample_clips = 0

    def step(self, grads, lr, *, taus=None, l2_factor=1.0, M_factor=1.0):
        g = [np.asarray(x, dtype=np.float64).copy() for x in grads]
        # nnet2: tau = lr g_in g_out sum_i ||xh_i|| ||gh_i||, at most mcps N
        if self.mcps > 0:
            for c, tau in enumerate(taus):
                if lr * tau > self.mcps * self.B:
                    g[c] *= self.mcps * self.B / (lr * tau)
                    self.per_sample_clips += 1
        # Kaldi: the objective gains l2_c ||theta_c||^2 per frame (factor 1/J)
        for c in range(len(g)):
            g[c] = g[c] + 2.0 * self.l2[c] * self.B * l2_factor * self.theta[c]
        if self.adapt is not None:
            K, decay = self.adapt
            for c in range(len(g)):
                sq = g[c] ** 2
                self.G[c] = decay * self.G[c] + np.where(np.isfinite(sq), sq, 0.0) \
                    if decay > 0 else sq
                g[c] = g[c] / np.sqrt(K + self.G[c])
        # nnet3: Delta accumulates -lr g; q = 1 - momentum
        for c in range(len(g)):
            self.delta[c] = self.delta[c] - lr * g[c]
        q = 1.0 - self.momentum
        with np.errstate(over="ignore", invalid="ignore"):
            n = [math.sqrt(float(np.sum(d * d))) for d in self.delta]
        if not all(math.isfinite(x) for x in n):
            self.skipped += 1
            self.delta = [np.zeros_like(d) for d in self.delta]
            return None
        k = [min(1.0, mc / (nc * abs(q))) if mc > 0 and nc > 0 else 1.0
             for nc, mc in zip(n, self.m)]
        total = abs(q) * math.sqrt(sum((kc * nc) ** 2 for kc, nc in zip(k, n)))
        M = self.M * M_factor
        if M > 0 and total > M:
            q = q * M / total
        for c in range(len(g)):
            self.theta[c] = self.theta[c] + q * k[c] * self.delta[c]
            self.delta[c] = self.momentum * self.delta[c]
        return [q * kc for kc in k]


def _setup(xp, *, minibatch=16, **options):
    net = build_network(feat_dim=3, num_classes=5, left_context=1, right_context=1,
                        hidden_layers=2, hidden_dim=6, xp=xp)
    net.init_params(seed=4)
    # every layer random (the output layer starts at zero), of size ~0.5
    net.params[...] = xp.asarray(np.random.default_rng(5).standard_normal(
        net.num_params).astype(np.float32) * 0.5)
    opt = SGD(net, minibatch=minibatch, **options)
    return net, opt


def _host(x):
    return np.array(backend.to_host(x), dtype=np.float64)


def _blocks(net):
    p = _host(net.params)
    return [p[sl] for _, sl in net.param_slices]


def _random_grads(rng, sizes, norms):
    """float32 blocks of the given Frobenius norms (None: a NaN block; 'inf': one inf)."""
    out = []
    for size, n in zip(sizes, norms):
        g = rng.standard_normal(size)
        if n is None:
            g[size // 2] = np.nan
        elif n == "inf":
            g[0] = np.inf
        elif n == 0:
            g[...] = 0
        else:
            g = g / np.linalg.norm(g) * n
        out.append(g.astype(np.float32))
    return out


# Per case: the optimizer's options, the minibatch, each step's (lr, gradient norms
# per layer) and whether to take tau (max-change-per-sample) per layer too.
LIMITS = dict(max_change_per_layer=0.75, max_change_output=1.5, max_change=2.0)
OFF = dict(max_change_per_layer=0, max_change_output=0, max_change=0)
STEPS = [(1.0, [0.3, 0.2, 0.4]), (1.0, [3.0, 0.5, 1.0]), (0.5, [8.0, 6.0, 9.0]),
         (0.1, [1.0, 2.0, 3.0]), (2.0, [0.2, 0.1, 0.05]), (1.0, [1.5, 0.9, 2.5])]
# momentum 0.9 limits 0.1 n_c: larger gradients reach the limits
STEPS_X10 = [(lr, [10 * n for n in norms]) for lr, norms in STEPS]
CASES = {
    # nnet3's defaults: hidden 0.75, output 1.5, whole model 2
    "defaults": (dict(LIMITS), 16, STEPS),
    # all limits 0: the plain step -lr g
    "all-off": (dict(OFF), 16, STEPS),
    # the global clip alone, and with tighter layer limits
    "global-only": (dict(OFF, max_change=1.0), 16, STEPS),
    "tight": (dict(max_change_per_layer=0.3, max_change_output=0.4, max_change=0.5), 16, STEPS),
    # momentum: Delta <- momentum Delta, limits against (1 - momentum) n_c
    "momentum-0.9": (dict(LIMITS, momentum=0.9), 16, STEPS_X10),
    "momentum-0.5": (dict(LIMITS, momentum=0.5), 16, STEPS),
    "momentum-0.9-off": (dict(OFF, momentum=0.9), 16, STEPS),
    # a layer without gradient: k = 1 there, no 0/0
    "zero-layer": (dict(LIMITS), 16, [(1.0, [0.0, 0.5, 3.0]), (1.0, [2.0, 0.0, 0.0]),
                                      (1.0, [0.0, 0.0, 0.0]), (0.5, [0.0, 9.0, 0.2])]),
    # a huge gradient in one layer only: that layer clipped, the others not
    "huge-one-layer": (dict(LIMITS), 16, [(1.0, [1e6, 0.3, 0.4]), (1.0, [0.2, 0.3, 1e8]),
                                          (0.01, [0.5, 1e12, 0.1])]),
    "huge-one-layer-momentum": (dict(LIMITS, momentum=0.9), 16,
                                [(1.0, [1e6, 0.3, 0.4]), (1.0, [0.2, 0.3, 0.1]),
                                 (1.0, [0.2, 1e7, 0.1])]),
    # a change whose norm is finite but whose square is not in float32 (> 1.8e19):
    # clipped like any other (the norms are of the change, not of float32 sums)
    "huge-beyond-float32-squares": (dict(LIMITS), 16, [(1.0, [1e21, 0.3, 0.4]),
                                                       (1.0, [0.2, 0.3, 0.1]),
                                                       (1e-3, [0.2, 1e25, 3e19])]),
    "huge-beyond-float32-squares-momentum": (dict(LIMITS, momentum=0.5), 16,
                                             [(1.0, [0.3, 0.3, 0.4]),
                                              (1.0, [0.2, 1e30, 0.1])]),
    # a step that is not finite is skipped and the momentum cleared; then on as before
    "non-finite": (dict(LIMITS), 16, [(1.0, [0.5, 0.5, 0.5]), (1.0, [0.5, None, 0.5]),
                                      (1.0, [0.5, 0.5, 0.5]), (1.0, ["inf", 0.5, 0.5]),
                                      (1.0, [3.0, 0.5, 0.5])]),
    "non-finite-momentum": (dict(LIMITS, momentum=0.9), 16,
                            [(1.0, [2.0, 0.5, 0.5]), (1.0, [0.5, 0.5, None]),
                             (1.0, [0.5, 0.5, 0.5]), (1.0, ["inf", 0.5, 0.5]),
                             (1.0, [0.5, 0.5, 4.0])]),
    "non-finite-off": (dict(OFF, momentum=0.5), 16, [(1.0, [0.5, 0.5, 0.5]),
                                                     (1.0, [None, 0.5, 0.5]),
                                                     (1.0, [0.5, 0.5, 0.5])]),
    # L2, hidden and output values, with and without the limits, minibatch 1
    "l2": (dict(LIMITS, l2_regularize=0.01, l2_regularize_output=0.03), 16, STEPS),
    "l2-off": (dict(OFF, l2_regularize=0.01, l2_regularize_output=0.03), 16, STEPS),
    "l2-minibatch-1": (dict(LIMITS, momentum=0.5, l2_regularize=0.2,
                            l2_regularize_output=0.05), 1, STEPS),
    # nnet2's max-change-per-sample, alone, with nnet3's limits, minibatch 1
    "mcps": (dict(OFF, max_change_per_sample=0.075), 32, STEPS),
    "mcps-limits-l2": (dict(LIMITS, max_change_per_sample=0.075, l2_regularize=0.01,
                            momentum=0.5), 32, STEPS),
    "mcps-minibatch-1": (dict(OFF, max_change_per_sample=0.5), 1, STEPS),
}


def _run(xp, options, minibatch, steps, *, adapt=None, factors=None):
    net, opt = _setup(xp, minibatch=minibatch, **options)
    if adapt is not None:
        opt.gradient_scaling = LimitedMemoryAdagrad(net.params, k=adapt[0], decay=adapt[1])
    last = len(net.param_slices) - 1
    m = [options.get("max_change_output", 1.5) if c == last else
         options.get("max_change_per_layer", 0.75) for c in range(last + 1)]
    l2 = [options.get("l2_regularize_output", 0.0) if c == last else
          options.get("l2_regularize", 0.0) for c in range(last + 1)]
    ref = Reference(_blocks(net), m=m, M=options.get("max_change", 2.0),
                    momentum=options.get("momentum", 0.0), l2=l2, B=minibatch,
                    mcps=options.get("max_change_per_sample", 0.0), adapt=adapt)
    sizes = [sl.stop - sl.start for _, sl in net.param_slices]
    rng = np.random.default_rng(11)
    clipped = False
    for t, (lr, norms) in enumerate(steps):
        grads = _random_grads(rng, sizes, norms)
        # tau per layer, around the limit mcps N / lr (both sides of it)
        taus = [float(rng.uniform(0.2, 3.0)) * options.get("max_change_per_sample", 0.0)
                * minibatch / lr for _ in sizes]
        for (layer, sl), g, tau in zip(net.param_slices, grads, taus):
            net.grads[sl] = xp.asarray(g)
            layer.step_bound = tau if xp is np else xp.asarray(np.float32(tau))
        l2_factor, M_factor, rate = 1.0, 1.0, lr
        if factors is not None:
            rate, l2_factor, M_factor, opt_lr = factors(t, lr)
            opt.set_l2_factor(l2_factor)
            opt.set_max_change_factor(M_factor)
        else:
            opt_lr = lr
        scales = ref.step(grads, rate, taus=taus, l2_factor=l2_factor, M_factor=M_factor)
        opt.step(opt_lr)
        assert opt.num_skipped == ref.skipped, f"step {t}"
        if scales is None:
            # a skipped step changed nothing: its factors are 0 (as the device reports)
            assert opt.last_scales == [0.0] * len(sizes), f"step {t}"
        else:
            np.testing.assert_allclose(opt.last_scales, scales, rtol=SCALE_RTOL,
                                       err_msg=f"scales, step {t}")
            clipped |= min(scales) < (1 - ref.momentum) * (1 - 1e-6)
        for c, (got, want) in enumerate(zip(_blocks(net), ref.theta)):
            np.testing.assert_allclose(got, want, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                       err_msg=f"layer {c}, step {t}")
        if opt.delta is not None:
            got = _host(opt.delta)
            for c, (_, sl) in enumerate(net.param_slices):
                np.testing.assert_allclose(got[sl], ref.delta[c], rtol=PARAM_RTOL,
                                           atol=PARAM_ATOL * max(1.0, np.abs(ref.delta[c]).max()),
                                           err_msg=f"momentum of layer {c}, step {t}")
    return clipped or ref.per_sample_clips > 0


# the host, the device's array expressions (on the stand-in), the fused kernels (GPU)
DEVICES = ["host", "standin", pytest.param("gpu", marks=pytest.mark.gpu)]


def _device(kind):
    if kind == "gpu":
        from mpitrain.testing import gpu_required
        xp = gpu_required()
        backend.set_fused_kernels(True)
        return contextlib.nullcontext(xp)
    return standin_cupy.installed() if kind == "standin" else contextlib.nullcontext(np)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_sgd_step_follows_the_float64_reference(case, device):
    options, minibatch, steps = CASES[case]
    with _device(device) as xp:
        clipped = _run(xp, options, minibatch, steps)
    limits_on = any(options.get(k, 1) for k in
                    ("max_change_per_layer", "max_change_output", "max_change")) \
        or options.get("max_change_per_sample")
    if limits_on and not case.startswith("non-finite"):
        assert clipped, "no step reached a limit: the case tests nothing of it"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_gradient_scaling_comes_after_l2_and_before_max_change(decay, device):
    options = dict(LIMITS, momentum=0.5, l2_regularize=0.05)
    steps = [(lr * 0.3, [n * 5 for n in norms]) for lr, norms in STEPS]
    with _device(device) as xp:
        assert _run(xp, options, 8, steps, adapt=(1.0, decay))


class _Ranks:
    """The strategy's view of a communicator: only its size and rank are read."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


@pytest.mark.parametrize("device", DEVICES)
def test_kaldi_method_rate_l2_factor_and_first_iterations_max_change(device):
    """Iteration i trains J_i jobs at J_i lr with the L2 term over J_i (Kaldi's
    l2_regularize_factor), and iteration 0 at M / sqrt(2): J ramps 2 -> 4 over
    3 iterations of 2 steps, J = (2, 3, 3) (v = 2, 2.67, 3.33)."""
    from mpitrain.parallel.kaldi_averaging import KaldiAveraging
    kaldi = KaldiAveraging(_Ranks(4), every_steps=2, total_steps=6, jobs_initial=2,
                           jobs_final=4)
    jobs = [2, 2, 3, 3, 3, 3]                     # per step, from the spec's ramp

    def factors(t, lr):
        J = jobs[t]
        M_factor = 2 ** -0.5 if t < 2 else 1.0
        # the reference's rate, l2 factor, M factor; and the rate the method gives
        assert kaldi.num_jobs(t) == J
        assert kaldi.l2_factor(t) == pytest.approx(1.0 / J)
        assert kaldi.max_change_factor(t) == pytest.approx(M_factor)
        return J * lr, 1.0 / J, M_factor, kaldi.learning_rate(lr, t)

    options = dict(LIMITS, l2_regularize=0.02, l2_regularize_output=0.01, momentum=0.25)
    # step 0: a whole-model change of ~1.84, clipped only by M / sqrt(2)
    steps = [(0.5, [3.0, 3.0, 3.0]), (0.5, [0.2, 3.0, 0.1]), (0.3, [3.0, 3.0, 3.0]),
             (0.3, [0.2, 0.2, 0.2]), (0.5, [5.0, 5.0, 5.0]), (0.1, [1.0, 1.0, 1.0])]
    with _device(device) as xp:
        assert _run(xp, options, 16, steps, factors=factors)


def test_the_summed_loss_gradient_and_its_step_at_rate_lr():
    """Learning-rate handling: the gradient is of the loss summed over the
    minibatch (not averaged) and the step with every limit off is -lr g.
    A float64 forward/backward of affine -> ReLU -> affine -> ReLU -> affine ->
    softmax cross-entropy; tau_c = sum_i ||[x_i, 1]|| ||dy_i|| for plain SGD."""
    xp = np
    N = 8
    net, opt = _setup(xp, minibatch=N, **OFF)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((N, net.input_dim)).astype(np.float32)
    labels = rng.integers(0, 5, N)
    W = [b.reshape(layer.out_dim, layer.in_dim + 1) for (layer, _), b in
         zip(net.param_slices, _blocks(net))]
    hs, zs = [x.astype(np.float64)], []
    for c, w in enumerate(W):
        z = hs[-1] @ w[:, :-1].T + w[:, -1]
        zs.append(z)
        hs.append(np.maximum(z, 0) if c < len(W) - 1 else z)
    logits = hs[-1]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dy = p.copy()
    dy[np.arange(N), labels] -= 1                  # d (sum of the rows' losses) / d logits
    grads, taus = [None] * len(W), [None] * len(W)
    for c in reversed(range(len(W))):
        xt = np.hstack([hs[c], np.ones((N, 1))])
        grads[c] = (dy.T @ xt).ravel()
        taus[c] = float(np.linalg.norm(xt, axis=1) @ np.linalg.norm(dy, axis=1))
        dy = (dy @ W[c][:, :-1]) * (zs[c - 1] > 0) if c else None
    for layer, _ in net.param_slices:
        layer.track_step_bound = True
    net.forward_backward(x, labels)
    g = _host(net.grads)
    for c, (layer, sl) in enumerate(net.param_slices):
        np.testing.assert_allclose(g[sl], grads[c], rtol=1e-4, atol=1e-5)
        assert float(layer.step_bound) == pytest.approx(taus[c], rel=1e-5)
    before = _blocks(net)
    opt.step(0.01)
    for c, (got, b) in enumerate(zip(_blocks(net), before)):
        np.testing.assert_allclose(got, b - 0.01 * grads[c], rtol=1e-5, atol=1e-6)


def test_natural_gradient_block_and_its_per_sample_bound():
    """With NG-SGD the gradient block is g_in g_out Gh^T Xh of the preconditioned
    rows, and nnet2's bound tau = g_in g_out sum_i ||xh_i|| ||gh_i|| (spec
    section 2), both from the preconditioners' own outputs, taken as returned."""
    from mpitrain.optim.ngsgd import NaturalGradientSGD
    net = build_network(feat_dim=3, num_classes=5, left_context=1, right_context=1,
                        hidden_layers=2, hidden_dim=6)
    net.params[...] = np.random.default_rng(5).standard_normal(
        net.num_params).astype(np.float32) * 0.5
    NaturalGradientSGD(net, rank_in=3, rank_out=2, minibatch=16, max_change_per_sample=0.1)
    seen = {}
    for c, layer in enumerate(net.affine_layers()):
        for side in ("in", "out"):
            p = getattr(layer, f"preconditioner_{side}")

            def spy(rows, p=p, key=(c, side)):
                out, gamma = p.__class__.precondition(p, rows)
                seen[key] = (np.float64(out).copy(), float(gamma))
                return out, gamma
            p.precondition = spy
    rng = np.random.default_rng(6)
    x = rng.standard_normal((16, net.input_dim)).astype(np.float32)
    labels = rng.integers(0, 5, 16)
    for _ in range(3):                  # past the first call's initialisation
        net.forward_backward(x, labels)
        g = _host(net.grads)
        for c, (layer, sl) in enumerate(net.param_slices):
            (xh, g_in), (gh, g_out) = seen[(c, "in")], seen[(c, "out")]
            assert g_in >= 1 and g_out >= 1
            np.testing.assert_allclose(g[sl], (g_in * g_out * gh.T @ xh).ravel(),
                                       rtol=1e-4, atol=1e-5 * np.abs(g[sl]).max())
            tau = g_in * g_out * float(np.linalg.norm(xh, axis=1) @ np.linalg.norm(gh, axis=1))
            assert float(layer.step_bound) == pytest.approx(tau, rel=1e-5)
