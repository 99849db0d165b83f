"""adapt (optim/adapt.py): You & Xu's per-parameter Adagrad with limited memory, on the
host and on the CuPy stand-in: the update equals the formula, max-change still acts on
the resulting change, the memory survives a state round trip, and a device step
reads nothing back."""

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.config import OptimizerConfig
from mpitrain.nn.network import build_network
from mpitrain.optim.factory import build_optimizer
from mpitrain.testing import standin_cupy

GAMMA, K = 0.008, 1.0


def _net(xp):
    net = build_network(feat_dim=4, num_classes=5, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=6, xp=xp)
    net.init_params(seed=2)
    return net


def _optimizer(net, decay, max_change=0.0, momentum=0.0):
    cfg = OptimizerConfig(schedule="adapt", adapt_k=K, adapt_decay=decay, momentum=momentum,
                          max_change_per_layer=max_change, max_change_output=max_change,
                          max_change=max_change)
    return build_optimizer(cfg, net)


def _gradients(n, size):
    rng = np.random.default_rng(4)
    # large and small elements, so sqrt(K + G) matters
    return [(rng.standard_normal(size) * 3.0).astype(np.float32) for _ in range(n)]


def _expected(params, grads, decay):
    params, memory = params.astype(np.float64), np.zeros_like(params, dtype=np.float64)
    for g in grads:
        memory = decay * memory + g.astype(np.float64) ** 2
        params = params - GAMMA / np.sqrt(K + memory) * g
    return params


def _train(xp, grads, decay, **options):
    net = _net(xp)
    opt = _optimizer(net, decay, **options)
    start = backend.to_host(net.params).copy()
    for g in grads:
        net.grads[...] = backend.to_device(g, xp)
        opt.step(GAMMA)
    return start, backend.to_host(net.params), opt


def test_k_is_added_under_the_square_root():
    # gamma g / sqrt(K + g^2) with K = adapt_k, not 1
    net = _net(np)
    cfg = OptimizerConfig(schedule="adapt", adapt_k=4.0, max_change_per_layer=0.0,
                          max_change_output=0.0, max_change=0.0)
    opt = build_optimizer(cfg, net)
    g = _gradients(1, net.num_params)[0]
    start = net.params.astype(np.float64)
    net.grads[...] = g
    opt.step(GAMMA)
    expected = start - GAMMA * g.astype(np.float64) / np.sqrt(4.0 + g.astype(np.float64) ** 2)
    np.testing.assert_allclose(net.params, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_update_equals_the_formula_on_a_scripted_gradient_sequence(decay):
    grads = _gradients(5, _net(np).num_params)
    start, params, _ = _train(np, grads, decay)
    np.testing.assert_allclose(params, _expected(start, grads, decay), rtol=1e-5, atol=1e-6)
    with standin_cupy.installed() as cp:
        _, on_device, _ = _train(cp, grads, decay)
    np.testing.assert_allclose(on_device, params, rtol=1e-6, atol=1e-7)


def test_paper_default_moves_each_parameter_at_most_gamma():
    grads = [np.full(_net(np).num_params, 100.0, np.float32)]
    start, params, _ = _train(np, grads, 0.0)
    assert np.all(np.abs(params - start) <= GAMMA) and np.all(np.abs(params - start) > 0.99 * GAMMA)


def test_max_change_acts_on_the_scaled_change():
    grads = _gradients(1, _net(np).num_params)
    start, params, opt = _train(np, grads, 0.0, max_change=0.01)
    change = params - start
    assert np.linalg.norm(change) <= 0.01 * 1.0001
    assert min(opt.last_scales) < 1.0


def test_memory_is_kept_in_the_optimizer_state_and_restored():
    grads = _gradients(6, _net(np).num_params)
    _, straight, _ = _train(np, grads, 0.9, momentum=0.5)
    net = _net(np)
    opt = _optimizer(net, 0.9, momentum=0.5)
    for g in grads[:3]:
        net.grads[...] = g
        opt.step(GAMMA)
    state = opt.state_dict()
    assert state["adapt"]["sum"].shape == net.params.shape
    again = _net(np)
    again.params[...] = net.params
    opt2 = _optimizer(again, 0.9, momentum=0.5)
    opt2.load_state_dict({k: (v.copy() if isinstance(v, np.ndarray) else v)
                          for k, v in state.items()})
    for g in grads[3:]:
        again.grads[...] = g
        opt2.step(GAMMA)
    np.testing.assert_array_equal(again.params, straight)
    with pytest.raises(ValueError, match="adapt/sum"):
        _optimizer(_net(np), 0.9).load_state_dict({"num_steps": 0, "adapt": {}})


def test_a_non_finite_gradient_is_skipped_and_leaves_the_memory_alone():
    net = _net(np)
    opt = _optimizer(net, 0.9)
    net.grads[...] = 1.0
    opt.step(GAMMA)
    memory = opt.gradient_scaling.sum.copy()
    before = net.params.copy()
    net.grads[...] = 1.0
    net.grads[3] = np.inf
    opt.step(GAMMA)
    assert opt.num_skipped == 1
    np.testing.assert_array_equal(net.params, before)
    assert np.all(np.isfinite(opt.gradient_scaling.sum))
    assert opt.gradient_scaling.sum[3] == pytest.approx(0.9 * memory[3])


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_device_steps_read_nothing_back(decay):
    grads = _gradients(3, _net(np).num_params)
    with standin_cupy.installed() as cp:
        net = _net(cp)
        opt = _optimizer(net, decay, max_change=2.0)
        device_grads = [backend.to_device(g, cp) for g in grads]
        net.grads[...] = device_grads[0]
        opt.step(GAMMA)
        before = backend.host_read_counts()["blocking"]
        standin_cupy.reset_counts()
        for g in device_grads[1:]:
            net.grads[...] = g
            opt.step(GAMMA)
        assert standin_cupy.READS == {"implicit": 0, "asnumpy": 0}
        assert backend.host_read_counts()["blocking"] == before
        assert not opt.static_step_ahead()       # no CUDA-graph capture of adapt steps


def test_a_k_that_float32_cannot_hold_is_refused():
    # added in float32, 1e-300 is 0: a parameter without gradient got 0 / 0
    from mpitrain.optim.adapt import LimitedMemoryAdagrad
    like = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match="smallest normal"):
        LimitedMemoryAdagrad(like, k=1e-300)
    scaling = LimitedMemoryAdagrad(like, k=float(np.finfo(np.float32).tiny))
    grads = np.array([0.0, 1e-30, 2.0], dtype=np.float32)
    scaling.scale_(grads)
    assert np.all(np.isfinite(grads))
