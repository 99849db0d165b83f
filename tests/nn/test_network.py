"""Whole networks: float64 central-difference gradients, the summed loss, one flat buffer."""

import numpy as np
import pytest

from mpitrain.nn.network import Network, build_network

from .gradcheck import numeric_grad


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
    np.testing.assert_allclose(analytic, numeric_grad(loss, net.params), rtol=1e-5, atol=1e-7)


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



def _held_buffers(net):
    return sum(len(c._buffers.keys()) for c in net.components if hasattr(c, "_buffers"))


@pytest.mark.parametrize("nonlinearity", ["relu", "sigmoid", "pnorm"])
def test_forward_without_keeping_buffers_releases_only_what_it_added(nonlinearity):
    def network():
        net = build_network(feat_dim=3, num_classes=4, left_context=1, right_context=1,
                            hidden_layers=2, hidden_dim=8, nonlinearity=nonlinearity,
                            pnorm_output_dim=4, normalize=True)
        net.init_params(seed=1)
        return net
    net, reference = network(), network()
    rng = np.random.default_rng(0)
    net.forward(rng.normal(size=(16, 9)).astype(np.float32))
    held, first = _held_buffers(net), net.first_input_view(16)
    for rows in range(1, 12):          # one pass per length, as utterances come
        x = rng.normal(size=(rows, 9)).astype(np.float32)
        got = net.forward(x, keep_buffers=False)
        np.testing.assert_array_equal(got, reference.forward(x))
        assert _held_buffers(net) == held             # nothing of `rows` rows stays
    # the buffers held before (a training step splices into the first) are the same
    assert net.first_input_view(16).ctypes.data == first.ctypes.data


def test_features_of_any_scale_are_normalised_and_constant_ones_stay_finite():
    # an absolute variance floor (1e-8) left features of tiny scale (x 1e-20, or
    # denormal) unnormalised: such a corpus trained to 0.21 where the same data
    # unscaled gave 0.99
    from mpitrain.nn.network import floored_variance
    rng = np.random.default_rng(0)
    feats = (rng.normal(size=(4000, 3)) * [1e-20, 3e-20, 0.0] + [0.0, 5e-20, 7.0])
    feats = feats.astype(np.float32)
    net = build_network(feat_dim=3, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=1, hidden_dim=4)
    net.set_cmvn(feats.mean(0, dtype=np.float64), feats.var(0, dtype=np.float64))
    out = net.normalize_frames(feats.copy())
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:, :2].std(0), 1.0, rtol=1e-3)
    np.testing.assert_array_equal(out[:, 2], 0.0)            # constant: nothing to scale
    # a constant dimension takes a typical variance; constant data stays finite in float32
    np.testing.assert_array_equal(floored_variance([1.0, 7.0], [4.0, 0.0]), [4.0, 4.0])
    assert np.isfinite(np.float32(1 / np.sqrt(floored_variance([0.0, 0.0], [0.0, 0.0])))).all()


def test_one_dimension_of_a_huge_scale_leaves_the_others_normalised():
    # the floor was 1e-12 of the largest variance of all dimensions: one finite
    # outlier (1e30 in one frame) or one dimension of a far larger scale floored
    # every other dimension to it, scaling them to nothing (a corpus of such data
    # trained to chance, the log saying 7 of 8 dimensions were constant)
    from mpitrain.nn.network import constant_dimensions
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(4000, 3)).astype(np.float32) + [1.0, 2.0, 0.0]
    feats[17, 2] = 1e30
    mean, var = feats.mean(0, dtype=np.float64), feats.var(0, dtype=np.float64)
    assert not constant_dimensions(mean, var).any()
    net = build_network(feat_dim=3, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=1, hidden_dim=4)
    net.set_cmvn(mean, var)
    out = net.normalize_frames(feats.copy())
    np.testing.assert_allclose(out[:, :2].std(0), 1.0, rtol=1e-3)


def test_a_constant_dimension_that_varies_elsewhere_is_scaled_like_a_typical_one():
    # it was scaled by 1e6 / sqrt(largest variance): held-out or exported frames
    # where it varies by 1 reached the first layer as 5e5
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(4000, 3)).astype(np.float32) * [1.0, 2.0, 0.0] + [0.0, 0.0, 5.0]
    net = build_network(feat_dim=3, num_classes=3, left_context=0, right_context=0,
                        hidden_layers=1, hidden_dim=4)
    net.set_cmvn(feats.mean(0, dtype=np.float64), feats.var(0, dtype=np.float64))
    np.testing.assert_array_equal(net.normalize_frames(feats.copy())[:, 2], 0.0)
    elsewhere = net.normalize_frames(np.array([[0.0, 0.0, 6.0]], dtype=np.float32))
    assert 0.2 < elsewhere[0, 2] < 1.0
