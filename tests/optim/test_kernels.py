"""The optimizers' kernels: the NumPy forms, and the fused GPU kernels (marked gpu)
of NG-SGD and of max-change SGD against NumPy and the host step."""

from __future__ import annotations

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.optim import kernels


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_numpy_kernels():
    rng = np.random.default_rng(22)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    assert kernels.sqnorm(x) == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-6)
    assert kernels.row_dots(x, 2 * x) == pytest.approx(2 * np.sum(x ** 2, axis=1), rel=1e-6)
    assert kernels.gamma(9.0, 1.0) == 3.0 and kernels.gamma(0.0, 0.0) == 1.0
    h, w = rng.standard_normal((5, 2)), rng.standard_normal((2, 4))
    y = x.astype(np.float64)
    kernels.subtract_product_(y, h, w, np.empty_like(y))
    assert y == pytest.approx(x - h @ w, abs=1e-6)
    j = np.zeros((2, 4))
    kernels.add_scaled_rows_(j, np.array([[2.0], [3.0]]), w)
    assert j == pytest.approx(np.array([[2.0], [3.0]]) * w)
    kernels.scale_rows_(j, np.array([[0.5], [1.0]]))
    assert j[0] == pytest.approx(w[0])


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_max_change_kernels_restricted_to_a_slice_equal_the_whole_step_there(cp, momentum):
    # a parameter server's slice: the fused kernels run over its layers' blocks only;
    # the other layers count as unchanged (norm 0), as with a zero gradient there
    from mpitrain.nn.network import build_network
    from mpitrain.optim.sgd import SGD

    def make():
        net = build_network(feat_dim=10, num_classes=50, left_context=1, right_context=1,
                            hidden_layers=3, hidden_dim=300, xp=cp)
        net.init_params(seed=4)
        return net, SGD(net, momentum=momentum)

    (wnet, whole), (pnet, part) = make(), make()
    slices = [sl for _, sl in wnet.param_slices]
    a, b = slices[1].start, slices[2].stop
    part.restrict_to(a, b)
    before = backend.to_host(pnet.params)
    rng = np.random.default_rng(5)
    for lr in (0.001, 30.0, 0.01):          # 30: max-change caps every layer
        g = rng.standard_normal(wnet.num_params).astype(np.float32)
        g[:a] = g[b:] = 0
        wnet.grads[...] = cp.asarray(g)
        g[:a] = g[b:] = np.nan
        pnet.grads[...] = cp.asarray(g)
        whole.step(lr)
        part.step(lr)
        got, want = backend.to_host(pnet.params), backend.to_host(wnet.params)
        np.testing.assert_array_equal(got[a:b], want[a:b])
        np.testing.assert_array_equal(got[:a], before[:a])
        np.testing.assert_array_equal(got[b:], before[b:])
    assert part.num_skipped == 0


@pytest.mark.gpu
def test_gpu_kernels_match_numpy(cp):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((33, 17)).astype(np.float32)
    y = rng.standard_normal((33, 17)).astype(np.float32)
    xd, yd = cp.asarray(x), cp.asarray(y)
    assert float(kernels.sqnorm(xd)) == pytest.approx(kernels.sqnorm(x), rel=1e-5)
    assert backend.to_host(kernels.row_dots(xd, yd)) == pytest.approx(
        kernels.row_dots(x, y), rel=1e-4, abs=1e-5)
    g = kernels.gamma(cp.asarray(np.float32(9.0)), cp.asarray(np.float32(4.0)))
    assert g.shape == () and float(g) == pytest.approx(1.5)
    assert float(kernels.gamma(cp.zeros((), cp.float32), cp.zeros((), cp.float32))) == 1.0
    h = rng.standard_normal((33, 3)).astype(np.float32)
    w = rng.standard_normal((3, 17)).astype(np.float32)
    xs = xd.copy()
    kernels.subtract_product_(xs, cp.asarray(h), cp.asarray(w), cp.empty_like(xs))
    assert rel_err(backend.to_host(xs), x - h @ w) < 1e-5
    col = rng.standard_normal((3, 1)).astype(np.float32)
    j = cp.asarray(y[:3])
    kernels.add_scaled_rows_(j, cp.asarray(col), cp.asarray(w))
    assert rel_err(backend.to_host(j), y[:3] + col * w) < 1e-5
    rows = rng.standard_normal((33, 1)).astype(np.float32)
    xs = xd.copy()
    kernels.scale_rows_(xs, cp.asarray(rows))
    assert rel_err(backend.to_host(xs), x * rows) < 1e-6
