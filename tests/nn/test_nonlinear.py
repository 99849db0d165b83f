"""Float64 central-difference checks of every layer and of whole networks."""

import numpy as np
import pytest

from mpitrain.nn.affine import Affine
from mpitrain.nn.network import Network, build_network
from mpitrain.nn.nonlinear import Normalize, PNorm, ReLU, Sigmoid

EPS = 1e-6


def _numeric_grad(f, array):
    """d f / d array by central differences (array is modified and restored)."""
    grad = np.zeros_like(array)
    flat, gflat = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + EPS
        up = f()
        flat[i] = saved - EPS
        down = f()
        flat[i] = saved
        gflat[i] = (up - down) / (2 * EPS)
    return grad


def _check_component(comp, x, *, rtol=1e-6, atol=1e-8):
    """Loss = sum(w * comp(x)) for a fixed random w; compare analytic and numeric."""
    rng = np.random.default_rng(0)
    params = np.zeros(comp.num_params)
    grads = np.zeros(comp.num_params)
    if comp.num_params:
        comp.bind(params, grads)
        params[...] = rng.standard_normal(comp.num_params)
    w = rng.standard_normal((x.shape[0], comp.out_dim))

    def loss():
        return float((comp.forward(x.copy()) * w).sum())

    comp.forward(x.copy())
    dx = comp.backward(w.copy(), need_input_grad=True)
    np.testing.assert_allclose(dx, _numeric_grad(loss, x), rtol=rtol, atol=atol)
    if comp.num_params:
        np.testing.assert_allclose(grads, _numeric_grad(loss, params), rtol=rtol, atol=atol)


def test_affine_gradients():
    x = np.random.default_rng(1).standard_normal((5, 4))
    _check_component(Affine(4, 3), x)


def test_relu_gradients():
    # keep inputs away from the kink at 0, where the derivative is undefined
    x = np.random.default_rng(2).standard_normal((6, 7))
    x[np.abs(x) < 1e-3] = 0.5
    _check_component(ReLU(7), x)


def test_sigmoid_gradients():
    _check_component(Sigmoid(5), np.random.default_rng(3).standard_normal((4, 5)))


@pytest.mark.parametrize("p", [2.0, 3.0])
def test_pnorm_gradients(p):
    _check_component(PNorm(12, 4, p=p), np.random.default_rng(4).standard_normal((3, 12)))


def test_pnorm_groups_are_contiguous():
    x = np.arange(12, dtype=np.float64).reshape(1, 12)
    y = PNorm(12, 3, p=2.0).forward(x)
    expected = [np.sqrt((x[0, g * 4:(g + 1) * 4] ** 2).sum()) for g in range(3)]
    np.testing.assert_allclose(y[0], expected)


def test_normalize_gradients_and_rms():
    x = np.random.default_rng(5).standard_normal((4, 6)) * 3
    _check_component(Normalize(6, target_rms=1.0), x)
    y = Normalize(6, target_rms=2.0).forward(x)
    np.testing.assert_allclose(np.sqrt((y ** 2).mean(axis=1)), 2.0)


def _float64_net(nonlinearity, normalize=False):
    net = build_network(feat_dim=3, num_classes=5, left_context=1, right_context=1,
                        hidden_layers=2, hidden_dim=8, nonlinearity=nonlinearity,
                        pnorm_output_dim=4, normalize=normalize)
    comps = net.components
    net64 = Network(comps, feat_dim=3, left_context=1, right_context=1, dtype="float64")
    net64.params[...] = np.random.default_rng(6).standard_normal(net64.num_params) * 0.5
    return net64


@pytest.mark.parametrize("nonlinearity,normalize",
                         [("relu", False), ("sigmoid", False), ("pnorm", True)])
def test_full_network_gradient(nonlinearity, normalize):
    net = _float64_net(nonlinearity, normalize)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, net.input_dim))
    labels = rng.integers(0, net.num_classes, 6)

    def loss():
        total, _ = net.evaluate_batch(x.copy(), labels)
        return float(total)

    net.forward_backward(x.copy(), labels)
    analytic = net.grads.copy()
    np.testing.assert_allclose(analytic, _numeric_grad(loss, net.params), rtol=1e-5, atol=1e-7)


def test_loss_is_summed_cross_entropy():
    net = _float64_net("relu")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, net.input_dim))
    labels = rng.integers(0, 5, 5)
    logits = net.forward(x.copy()).copy()
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    total, correct = net.evaluate_batch(x.copy(), labels)
    assert float(total) == pytest.approx(-logp[np.arange(5), labels].sum(), rel=1e-10)
    assert int(correct) == int((logits.argmax(1) == labels).sum())


def test_parameters_are_views_of_one_flat_buffer():
    net = build_network(feat_dim=4, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=2, hidden_dim=6)
    net.params[...] = 7.0
    for layer in net.affine_layers():
        assert np.all(layer.weight == 7.0) and np.all(layer.bias == 7.0)
        assert np.shares_memory(layer.block, net.params)
        assert np.shares_memory(layer.grad_block, net.grads)
    assert net.num_params == (4 + 1) * 6 + (6 + 1) * 6 + (6 + 1) * 3
