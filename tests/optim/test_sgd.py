"""SGD: Kaldi's max-change per layer and globally, momentum, skipped non-finite steps."""

import numpy as np
import pytest

from mpitrain.nn.network import build_network
from mpitrain.optim.sgd import SGD


def _net():
    net = build_network(feat_dim=2, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=2, hidden_dim=4)
    net.init_params(seed=0)
    return net


def _set_grads(net, norms):
    """Gradient blocks with the given Frobenius norms (lr = 1 makes them the deltas)."""
    rng = np.random.default_rng(1)
    for (_, sl), n in zip(net.param_slices, norms):
        g = rng.standard_normal(sl.stop - sl.start)
        net.grads[sl] = (g / np.linalg.norm(g) * n).astype(np.float32)


def test_max_change_matches_spec_example():
    # spec: n = (3, 0.5, 1), m = (0.75, 0.75, 1.5) -> k = (0.25, 1, 1), global 1.3463
    net = _net()
    opt = SGD(net, max_change_per_layer=0.75, max_change_output=1.5, max_change=2.0)
    _set_grads(net, [3.0, 0.5, 1.0])
    before = net.params.copy()
    opt.step(lr=1.0)
    np.testing.assert_allclose(opt.last_scales, [0.25, 1.0, 1.0], rtol=1e-5)
    change = [np.linalg.norm((net.params - before)[sl]) for _, sl in net.param_slices]
    np.testing.assert_allclose(change, [0.75, 0.5, 1.0], rtol=1e-4)
    assert np.linalg.norm(net.params - before) == pytest.approx(1.3463, abs=1e-4)


def test_global_max_change_clips():
    net = _net()
    opt = SGD(net, max_change_per_layer=0.75, max_change_output=1.5, max_change=1.0)
    _set_grads(net, [3.0, 0.5, 1.0])
    opt.step(lr=1.0)
    np.testing.assert_allclose(opt.last_scales, [0.74278 * 0.25, 0.74278, 0.74278], rtol=1e-4)


def test_non_finite_step_is_skipped():
    net = _net()
    opt = SGD(net)
    before = net.params.copy()
    net.grads[...] = 0
    net.grads[0] = np.nan
    opt.step(lr=0.1)
    np.testing.assert_array_equal(net.params, before)
    assert opt.num_skipped == 1


def test_plain_step_is_minus_lr_grad_without_clipping():
    net = _net()
    opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0)
    grads = np.random.default_rng(2).standard_normal(net.num_params).astype(np.float32)
    before = net.params.copy()
    net.grads[...] = grads
    opt.step(lr=0.01)
    np.testing.assert_allclose(net.params, before - 0.01 * grads, rtol=1e-6, atol=1e-7)


def test_momentum_accumulates_and_scales_by_one_minus_momentum():
    net = _net()
    opt = SGD(net, momentum=0.5, max_change_per_layer=0, max_change_output=0, max_change=0)
    g = np.full(net.num_params, 1.0, np.float32)
    p0 = net.params.copy()
    net.grads[...] = g
    opt.step(lr=1.0)          # delta = -g; apply 0.5 * delta; delta <- -0.5 g
    np.testing.assert_allclose(net.params, p0 - 0.5, atol=1e-6)
    net.grads[...] = g
    opt.step(lr=1.0)          # delta = -1.5 g; apply -0.75
    np.testing.assert_allclose(net.params, p0 - 1.25, atol=1e-6)
    state = opt.state_dict()
    opt2 = SGD(net, momentum=0.5)
    opt2.load_state_dict(state)
    np.testing.assert_array_equal(opt2.delta, opt.delta)
