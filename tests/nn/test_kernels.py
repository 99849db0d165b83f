"""The fused GPU kernels and the cuBLAS path of backend.gemm against NumPy.

Skipped without CuPy and a CUDA device; MPITRAIN_TEST_GPU=1 turns the skip
into a failure.  Tolerances: float32 elementwise kernels agree with NumPy to
a few ulps (rtol 1e-5); sums over a minibatch are accumulated in float64 on
the GPU and in float32 pairwise by NumPy (rtol 1e-5 over <= 4096 rows);
GEMMs with inner dimension K differ by ~sqrt(K) ulps (rtol 1e-4 at K <= 2048).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.data.splice import splice_batch_, splice, splice_indices
from mpitrain.nn.kernels import relu_backward, softmax_xent_
from mpitrain.optim import kernels as optim_kernels
from mpitrain.testing import gpu_required

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    xp = gpu_required()
    backend.set_fused_kernels(True)
    assert backend.fused_kernels(xp)
    return xp


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


def test_splice_kernel_writes_a_layer_input_view(cp):
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((300, 7)).astype(np.float32)
    offsets = np.array([0, 40, 41, 190, 300])
    starts = np.repeat(offsets[:-1], np.diff(offsets))
    ends = np.repeat(offsets[1:], np.diff(offsets))
    idx = rng.permutation(300)[:64]
    want = splice(feats, splice_indices(idx, starts[idx], ends[idx], 3, 2))
    buffer = cp.full((64, 6 * 7 + 1), 5.0, dtype=cp.float32)   # an input with its bias column
    view = buffer[:, :42]
    splice_batch_(cp.asarray(feats), cp.asarray(idx), cp.asarray(starts), cp.asarray(ends),
                  3, 2, out=view)
    got = backend.to_host(buffer)
    np.testing.assert_array_equal(got[:, :42], want)
    assert (got[:, 42] == 5.0).all(), "the bias column is not touched"


@pytest.mark.parametrize("momentum", [0.0, 0.5])
@pytest.mark.parametrize("lr", [0.001, 30.0])      # 30: max-change caps every layer
def test_max_change_kernels_match_the_host_step(cp, momentum, lr):
    from mpitrain.nn.network import build_network
    from mpitrain.optim.sgd import SGD

    def make(xp):
        net = build_network(feat_dim=10, num_classes=50, left_context=1, right_context=1,
                            hidden_layers=3, hidden_dim=300, xp=xp)
        net.init_params(seed=4)
        return net, SGD(net, momentum=momentum)

    (hnet, hopt), (dnet, dopt) = make(np), make(cp)
    rng = np.random.default_rng(5)
    for _ in range(3):
        g = rng.standard_normal(hnet.num_params).astype(np.float32)
        hnet.grads[...] = g
        dnet.grads[...] = cp.asarray(g)
        hopt.step(lr)
        dopt.step(lr)
        np.testing.assert_allclose(dopt.last_scales, hopt.last_scales, rtol=1e-5)
        np.testing.assert_allclose(backend.to_host(dnet.params), hnet.params, rtol=1e-5,
                                   atol=1e-6)
    # a non-finite gradient skips the step on both
    before = backend.to_host(dnet.params)
    dnet.grads[7] = cp.nan
    dopt.step(lr)
    assert dopt.num_skipped == 1 and dopt.num_steps == 3
    np.testing.assert_array_equal(backend.to_host(dnet.params), before)
    if momentum:
        assert not bool(cp.any(dopt.delta))


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_gemm_matches_numpy(cp, trans_a, trans_b):
    rng = np.random.default_rng(6)
    m, k, n = 70, 2048, 33
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    c = rng.standard_normal((m, n + 1)).astype(np.float32)   # a strided output view
    want = 0.5 * ((a.T if trans_a else a) @ (b.T if trans_b else b)) + 2.0 * c[:, :n]
    out = cp.asarray(c)
    backend.gemm(cp.asarray(a), cp.asarray(b), out[:, :n], trans_a=trans_a, trans_b=trans_b,
                 alpha=0.5, beta=2.0)
    got = backend.to_host(out)
    np.testing.assert_allclose(got[:, :n], want, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(got[:, n], c[:, n])
    # alpha read from the device
    out2 = cp.empty((m, n), dtype=cp.float32)
    backend.gemm(cp.asarray(a), cp.asarray(b), out2, trans_a=trans_a, trans_b=trans_b,
                 alpha=cp.asarray(np.float32(3.0)))
    np.testing.assert_allclose(backend.to_host(out2),
                               3.0 * ((a.T if trans_a else a) @ (b.T if trans_b else b)),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("precision,rtol", [("tf32", 5e-3), ("bf16", 3e-2)])
def test_reduced_precision_gemm_is_close(cp, precision, rtol):
    """TF32 keeps 10 mantissa bits (relative error ~1e-3 per product), bf16 7 bits."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((256, 512)).astype(np.float32)
    b = rng.standard_normal((512, 128)).astype(np.float32)
    out = cp.empty((256, 128), dtype=cp.float32)
    backend.set_precision(cp, precision)
    try:
        backend.gemm(cp.asarray(a), cp.asarray(b), out)
    finally:
        backend.set_precision(cp, "fp32")
    want = a @ b
    err = np.linalg.norm(backend.to_host(out) - want) / np.linalg.norm(want)
    assert err < rtol


def test_async_host_copy_waits_only_for_its_data(cp):
    x = cp.arange(1000, dtype=cp.float32)
    pending = backend.copy_to_host_async(x * 2)
    np.testing.assert_array_equal(pending.result(), np.arange(1000, dtype=np.float32) * 2)


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
