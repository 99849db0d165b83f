"""CD-1 (nn/rbm.py): the statistics against a float64 computation written from the
update rule, the momentum and weight-decay step, and learning on tiny problems."""

import numpy as np
import pytest

from mpitrain.nn.rbm import RBM, ContrastiveDivergence, RBMStack


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _reference_cd1(params, v0, u, visible, hidden_dim):
    """(gW, gb, ga, squared error) of eqn:cd1 in float64, from the flat layout."""
    params = params.astype(np.float64)
    vdim = v0.shape[1]
    block = params[:hidden_dim * (vdim + 1)].reshape(hidden_dim, vdim + 1)
    w, b, a = block[:, :vdim], block[:, vdim], params[hidden_dim * (vdim + 1):]
    v0 = v0.astype(np.float64)
    h0 = _sigmoid(v0 @ w.T + b)
    hs = (u < h0).astype(np.float64)
    v1 = hs @ w + a
    if visible == "bernoulli":
        v1 = _sigmoid(v1)
    h1 = _sigmoid(v1 @ w.T + b)
    n = len(v0)
    return ((h0.T @ v0 - h1.T @ v1) / n, (h0 - h1).mean(0), (v0 - v1).mean(0),
            ((v0 - v1) ** 2).sum())


@pytest.mark.parametrize("visible", ["gaussian", "bernoulli"])
def test_cd1_statistics_match_a_float64_computation(visible, xp):
    rng = np.random.default_rng(0)
    rbm = RBM(7, 5, visible=visible, xp=xp)
    rbm.init_params(seed=1, std=0.5)
    rbm.params[...] += xp.asarray(rng.standard_normal(rbm.num_params).astype(np.float32) * 0.1)
    v0 = rng.standard_normal((11, 7)).astype(np.float32)
    if visible == "bernoulli":
        v0 = (v0 > 0).astype(np.float32)
    u = rng.random((11, 5), dtype=np.float32)
    sq_err = rbm.statistics_(xp.asarray(v0), xp.asarray(u))
    gw, gb, ga, err = _reference_cd1(np.asarray(rbm.params.tolist()), v0, u, visible, 5)
    grads = np.asarray(rbm.grads.tolist())
    n = 5 * 8
    np.testing.assert_allclose(grads[:n].reshape(5, 8)[:, :7], gw, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[:n].reshape(5, 8)[:, 7], gb, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[n:], ga, rtol=1e-4, atol=1e-5)
    assert float(sq_err) == pytest.approx(err, rel=1e-4)


def test_step_applies_momentum_rate_scaling_and_weight_decay():
    rng = np.random.default_rng(2)
    rbm = RBM(4, 3, visible="gaussian")
    rbm.init_params(seed=3)
    cd = ContrastiveDivergence(rbm, weight_decay=0.01)
    v0, u = rng.standard_normal((6, 4)).astype(np.float32), rng.random((6, 3), dtype=np.float32)
    start = rbm.params.astype(np.float64).copy()
    cd.delta[...] = 0.25
    rbm.statistics_(v0, u)
    g = rbm.grads.astype(np.float64).copy()
    g[:3 * 5].reshape(3, 5)[:, :4] -= 0.01 * start[:3 * 5].reshape(3, 5)[:, :4]
    expected_delta = 0.8 * 0.25 + 0.1 * (1 - 0.8) * g
    cd.step(v0, u, learning_rate=0.1, momentum=0.8)
    np.testing.assert_allclose(cd.delta, expected_delta, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(rbm.params, start + expected_delta, rtol=1e-5, atol=1e-7)


def _train(rbm, data, steps, lr, seed=0):
    cd = ContrastiveDivergence(rbm, weight_decay=0.0002)
    rng = np.random.default_rng(seed)
    errors = []
    for _ in range(steps):
        v = data[rng.integers(0, len(data), 20)]
        u = rng.random((20, rbm.hidden_dim), dtype=np.float32)
        errors.append(float(cd.step(v, u, learning_rate=lr, momentum=0.5)) / v.size)
    return np.mean(errors[:20]), np.mean(errors[-20:])


def test_cd1_lowers_the_reconstruction_error_on_a_tiny_problem():
    rng = np.random.default_rng(4)
    # Bernoulli: noisy copies of 3 binary prototypes
    prototypes = rng.random((3, 16)) < 0.5
    picks = prototypes[rng.integers(0, 3, 400)]
    flips = rng.random(picks.shape) < 0.05
    data = (picks ^ flips).astype(np.float32)
    rbm = RBM(16, 8, visible="bernoulli")
    rbm.init_params(seed=1)
    first, last = _train(rbm, data, 400, lr=0.4)
    assert last < 0.5 * first
    # Gaussian: normalised features on a low-dimensional subspace
    factors = rng.standard_normal((400, 3)) @ rng.standard_normal((3, 12))
    gauss = ((factors - factors.mean(0)) / factors.std(0)).astype(np.float32)
    rbm = RBM(12, 16, visible="gaussian")
    rbm.init_params(seed=1)
    first, last = _train(rbm, gauss, 600, lr=0.05)
    assert last < 0.7 * first


def test_stack_propagates_through_its_layers_and_checks_dimensions():
    bottom, top = RBM(6, 4, visible="gaussian"), RBM(4, 3)
    bottom.init_params(seed=1)
    top.init_params(seed=2)
    stack = RBMStack([bottom, top], feat_dim=2, left_context=1, right_context=1,
                     cmvn_mean=np.zeros(2), cmvn_scale=np.ones(2))
    v = np.ones((5, 6), dtype=np.float32)
    assert stack.propagate(v).shape == (5, 3)
    np.testing.assert_allclose(stack.propagate(v, layers=1), bottom.hidden_probabilities(v))
    with pytest.raises(ValueError, match="RBM 1 has 5 visible units"):
        RBMStack([bottom, RBM(5, 3)], feat_dim=2, left_context=1, right_context=1,
                 cmvn_mean=np.zeros(2), cmvn_scale=np.ones(2))
