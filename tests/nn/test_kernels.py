"""The fused GPU kernels of nn (softmax cross-entropy, ReLU backward) against NumPy.

Skipped without CuPy and a CUDA device; MPITRAIN_TEST_GPU=1 turns the skip
into a failure.  Tolerances: float32 elementwise kernels agree with NumPy to
a few ulps (rtol 1e-5); sums over a minibatch are accumulated in float64 on
the GPU and in float32 pairwise by NumPy (rtol 1e-5 over <= 4096 rows).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.nn.kernels import relu_backward, softmax_xent_

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,c", [(64, 12), (512, 4000), (3, 300), (256, 120)])
@pytest.mark.parametrize("need_grad", [True, False])
def test_softmax_xent_matches_numpy(cp, n, c, need_grad):
    rng = np.random.default_rng(n + c)
    logits = (rng.standard_normal((n, c)) * 4).astype(np.float32)
    logits[0, :] = 0.0                                # a tie: argmax takes the first index
    labels = rng.integers(0, c, n).astype(np.int64)   # int64 labels are converted
    host, host_sums = logits.copy(), np.zeros(2)
    softmax_xent_(host, labels, host_sums, need_grad=need_grad)
    dev, dev_sums = cp.asarray(logits), cp.zeros(2, dtype=cp.float64)
    softmax_xent_(dev, cp.asarray(labels), dev_sums, need_grad=need_grad)
    softmax_xent_(dev.copy() if not need_grad else cp.asarray(logits), cp.asarray(labels),
                  dev_sums, need_grad=need_grad)       # sums accumulate
    got = backend.to_host(dev_sums)
    assert got[0] == pytest.approx(2 * host_sums[0], rel=1e-5)
    assert got[1] == 2 * host_sums[1]
    if need_grad:
        np.testing.assert_allclose(backend.to_host(dev), host, rtol=1e-5, atol=1e-7)
        # the gradient of the summed loss: each row sums to zero
        assert np.abs(backend.to_host(dev).sum(axis=1)).max() < 1e-5


def test_relu_backward_matches_numpy_on_strided_views(cp):
    rng = np.random.default_rng(1)
    y = rng.standard_normal((33, 41)).astype(np.float32)
    dy = rng.standard_normal((33, 40)).astype(np.float32)
    out = cp.empty((33, 40), dtype=cp.float32)
    relu_backward(cp.asarray(dy), cp.asarray(y)[:, :40], out, None)
    np.testing.assert_array_equal(backend.to_host(out), dy * (y[:, :40] > 0))


def test_fused_and_plain_kernels_train_alike(cp):
    """The switch `fused_kernels: false` gives the same training (to float32 rounding)."""
    from mpitrain.nn.network import build_network
    from mpitrain.optim.ngsgd import NaturalGradientSGD

    def train(fused):
        backend.set_fused_kernels(fused)
        try:
            net = build_network(feat_dim=8, num_classes=20, left_context=2, right_context=2,
                                hidden_layers=2, hidden_dim=64, xp=cp)
            net.init_params(seed=1)
            opt = NaturalGradientSGD(net, momentum=0.5)
            rng = np.random.default_rng(8)
            for _ in range(16):
                x = cp.asarray(rng.standard_normal((128, 40)).astype(np.float32))
                labels = cp.asarray(rng.integers(0, 20, 128))
                net.forward_backward(x, labels)
                opt.step(0.01)
            return backend.to_host(net.params)
        finally:
            backend.set_fused_kernels(True)

    np.testing.assert_allclose(train(True), train(False), rtol=1e-3, atol=1e-5)


def test_a_confident_model_gives_no_subnormal_gradients_on_the_host():
    # classes 80-100 nats below the best: their float32 probabilities would be
    # subnormal, and subnormals make the CPU's backward products several times slower
    logits = np.zeros((4, 6), np.float32)
    logits[:, 1:] = -np.array([20.0, 80.0, 90.0, 95.0, 100.0], np.float32)
    labels = np.array([0, 0, 1, 0], np.int32)
    reference = logits.astype(np.float64)
    sums = np.zeros(2)
    softmax_xent_(logits, labels, sums)
    tiny = np.finfo(np.float32).tiny
    assert not np.any((logits != 0) & (np.abs(logits) < tiny)), logits
    # the loss and the gradient's normal entries are those of float64 softmax
    probs = np.exp(reference - reference.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    expected = -np.log(probs[np.arange(4), labels]).sum()
    assert sums[0] == pytest.approx(expected, rel=1e-6)
    probs[np.arange(4), labels] -= 1
    # (float32 resolves p - 1 only to about 1e-7 near p = 1)
    np.testing.assert_allclose(logits, probs, rtol=1e-5, atol=1e-7)
