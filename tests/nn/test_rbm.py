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


@pytest.mark.parametrize("visible", ["gaussian", "bernoulli"])
def test_step_applies_momentum_rate_scaling_and_weight_decay(visible):
    # eqn:step for both kinds of visible units (the Gaussian one's guard aside)
    rng = np.random.default_rng(2)
    rbm = RBM(4, 3, visible=visible)
    rbm.init_params(seed=3)
    cd = ContrastiveDivergence(rbm, weight_decay=0.01)
    v0, u = rng.standard_normal((6, 4)).astype(np.float32), rng.random((6, 3), dtype=np.float32)
    if visible == "bernoulli":
        v0 = (v0 > 0).astype(np.float32)
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


def _guard_case(wide: bool):
    """A Gaussian RBM and a minibatch whose reconstruction is (``wide``) or is not
    more than twice as spread as the data."""
    rng = np.random.default_rng(5)
    rbm = RBM(6, 40, visible="gaussian")
    rbm.init_params(seed=2, std=0.6 if wide else 0.05)
    rbm.hidden_bias[...] = 0.3
    rbm.visible_bias[...] = np.linspace(-0.2, 0.2, 6).astype(np.float32)
    v0 = rng.standard_normal((9, 6)).astype(np.float32)
    u = rng.random((9, 40), dtype=np.float32)
    return rbm, v0, u


def _reference_guard(params, v0, u, hidden_dim):
    """(fired, scale) of eqn:guard in float64: one standard deviation over all the
    entries of the data and of its reconstruction (the Gaussian mean, no noise)."""
    params = params.astype(np.float64)
    vdim = v0.shape[1]
    block = params[:hidden_dim * (vdim + 1)].reshape(hidden_dim, vdim + 1)
    w, b, a = block[:, :vdim], block[:, vdim], params[hidden_dim * (vdim + 1):]
    v0 = v0.astype(np.float64)
    v1 = (u < _sigmoid(v0 @ w.T + b)).astype(np.float64) @ w + a
    s0, s1 = v0.std(), v1.std()
    return s1 > 2 * s0, s0 / s1


def test_a_reconstruction_twice_as_spread_as_the_data_scales_the_rbm_down(xp):
    """Kaldi's guard for Gaussian visible units (eqn:guard): W, b and a scaled by
    std(v0) / std(v1), no step taken, momentum reset, the rate cut by 0.9 for the
    steps after; the error is the minibatch's still."""
    from mpitrain import backend
    rbm, v0, u = _guard_case(wide=True)
    start = rbm.params.copy()
    fired, scale = _reference_guard(start, v0, u, 40)
    assert fired and scale < 0.5
    device = RBM(6, 40, visible="gaussian", xp=xp)
    device.params[...] = xp.asarray(start)
    cd = ContrastiveDivergence(device, weight_decay=0.01)
    cd.delta[...] = 0.25
    sq_err = cd.step(xp.asarray(v0), xp.asarray(u), learning_rate=0.1, momentum=0.5)
    params = backend.to_host(device.params)
    np.testing.assert_allclose(params, start.astype(np.float64) * scale, rtol=1e-5, atol=1e-7)
    assert not backend.to_host(cd.delta).any()
    assert float(cd.rate_factor) == pytest.approx(0.9) and float(cd.fired) == 1
    assert float(sq_err) == pytest.approx(_reference_cd1(start, v0, u, "gaussian", 40)[3],
                                          rel=1e-4)
    # the next step, within the spread now, is eqn:step at 0.9 times the rate
    before = params.astype(np.float64).copy()
    device.statistics_(xp.asarray(v0), xp.asarray(u))
    g = backend.to_host(device.grads).astype(np.float64)
    g[:40 * 7].reshape(40, 7)[:, :6] -= 0.01 * before[:40 * 7].reshape(40, 7)[:, :6]
    cd.step(xp.asarray(v0), xp.asarray(u), learning_rate=0.1, momentum=0.5)
    assert float(cd.fired) == 1
    np.testing.assert_allclose(backend.to_host(device.params),
                               before + 0.9 * 0.1 * 0.5 * g, rtol=1e-5, atol=1e-7)
    cd.reset_rate_factor()
    assert float(cd.rate_factor) == 1.0


def test_a_reconstruction_within_twice_the_spread_takes_the_plain_step_bit_for_bit():
    rbm, v0, u = _guard_case(wide=False)
    fired, _ = _reference_guard(rbm.params, v0, u, 40)
    assert not fired
    plain = RBM(6, 40, visible="gaussian")
    plain.params[...] = rbm.params
    cd = ContrastiveDivergence(rbm)
    cd.delta[...] = 0.25
    cd.step(v0, u, learning_rate=0.1, momentum=0.5)
    # eqn:step as written before the guard, in the same float32 operations
    delta = np.full_like(plain.params, 0.25)
    plain.statistics_(v0, u)
    plain.grad_block[:, :6] -= 0.0002 * plain.weight
    delta *= 0.5
    delta += (0.1 * (1.0 - 0.5)) * plain.grads
    plain.params += delta
    np.testing.assert_array_equal(rbm.params, plain.params)
    np.testing.assert_array_equal(cd.delta, delta)
    assert float(cd.rate_factor) == 1.0 and float(cd.fired) == 0


def test_bernoulli_visible_units_have_no_guard():
    rbm = RBM(6, 40, visible="bernoulli")
    rbm.init_params(seed=2, std=3.0)
    rng = np.random.default_rng(1)
    v0 = (rng.random((9, 6)) < 0.1).astype(np.float32)
    cd = ContrastiveDivergence(rbm)
    cd.step(v0, rng.random((9, 40), dtype=np.float32), learning_rate=0.1, momentum=0.5)
    assert float(cd.rate_factor) == 1.0 and float(cd.fired) == 0 and cd.delta.any()


def test_the_guard_decides_on_the_device_without_a_read():
    """Its test and choice are device operations: a step reads nothing back."""
    from mpitrain import backend
    from mpitrain.testing import standin_cupy
    for wide in (True, False):
        rbm, v0, u = _guard_case(wide=wide)
        with standin_cupy.installed() as cp:
            device = RBM(6, 40, visible="gaussian", xp=cp)
            device.params[...] = cp.asarray(rbm.params)
            cd = ContrastiveDivergence(device)
            v0d, ud = cp.asarray(v0), cp.asarray(u)
            before = dict(standin_cupy.READS), backend.host_read_counts()["blocking"]
            for _ in range(3):
                cd.step(v0d, ud, learning_rate=0.1, momentum=0.5)
            assert dict(standin_cupy.READS) == before[0]
            assert backend.host_read_counts()["blocking"] == before[1]
            assert float(cd.fired) == (1 if wide else 0)


def test_the_rate_factor_is_state_and_an_old_state_without_it_loads_as_1():
    rbm, v0, u = _guard_case(wide=True)
    cd = ContrastiveDivergence(rbm)
    cd.step(v0, u, learning_rate=0.1, momentum=0.5)
    state = cd.state_dict()
    assert state["rate_factor"] == pytest.approx(0.9)
    other = ContrastiveDivergence(rbm)
    other.load_state_dict(state)
    assert float(other.rate_factor) == state["rate_factor"]
    other.load_state_dict({"delta": state["delta"]})
    assert float(other.rate_factor) == 1.0
    for bad in (0.0, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="rate_factor is .*; expected a number in"):
            other.load_state_dict({**state, "rate_factor": bad})
