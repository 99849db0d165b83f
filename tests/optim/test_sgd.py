"""SGD: Kaldi's max-change per layer and globally, momentum, skipped non-finite steps."""

import numpy as np
import pytest

from mpitrain.nn.network import build_network
from mpitrain.optim.adapt import LimitedMemoryAdagrad
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


# -------------------------------------------- a slice of the model (restrict_to)

def _sliced_pair(xp, options, span_layers):
    """(whole, part, (start, stop)): two identical nets and optimizers; ``part``
    steps only the layers ``span_layers`` (a range of layer indices)."""
    from mpitrain.optim.adapt import LimitedMemoryAdagrad
    from mpitrain.optim.ngsgd import NaturalGradientSGD
    pair = []
    for _ in range(2):
        net = build_network(feat_dim=3, num_classes=5, left_context=1, right_context=1,
                            hidden_layers=3, hidden_dim=6, xp=xp)
        net.init_params(seed=2)
        net.params[...] += xp.asarray(np.random.default_rng(3).standard_normal(
            net.num_params).astype(np.float32) * 0.1)
        kind = dict(options)
        cls = NaturalGradientSGD if kind.pop("ngsgd", False) else SGD
        decay = kind.pop("adapt_decay", None)
        if decay is not None:
            kind["gradient_scaling"] = LimitedMemoryAdagrad(net.params, k=1.0, decay=decay)
        pair.append((net, cls(net, minibatch=8, **kind)))
    slices = [sl for _, sl in pair[0][0].param_slices]
    span = (slices[span_layers[0]].start, slices[span_layers[-1]].stop)
    pair[1][1].restrict_to(*span)
    return pair[0], pair[1], span


SLICE_CASES = {
    "plain": dict(max_change_per_layer=0, max_change_output=0, max_change=0),
    "max-change": dict(max_change_per_layer=0.3, max_change_output=0.4, max_change=0.5),
    "momentum": dict(momentum=0.5, max_change_per_layer=0.3, max_change=0.5),
    "adapt": dict(adapt_decay=0.9, max_change=0.5),
    "l2": dict(l2_regularize=0.01, l2_regularize_output=0.02, max_change=0),
    "ngsgd": dict(ngsgd=True, momentum=0.25, max_change=0.5),
}


@pytest.mark.parametrize("device", ["host", "standin"])
@pytest.mark.parametrize("layers", [range(0, 2), range(1, 2), range(2, 4)])
@pytest.mark.parametrize("case", sorted(SLICE_CASES))
def test_a_step_restricted_to_a_slice_is_the_whole_step_there_bit_for_bit(case, layers,
                                                                          device):
    # the whole step with a zero gradient outside the slice is what a server of a
    # split model computed before; restricted, the gradient outside is not read
    # (NaN there) and the parameters and buffers outside are not touched
    import contextlib
    from mpitrain import backend
    from mpitrain.testing import standin_cupy
    context = standin_cupy.installed() if device == "standin" else contextlib.nullcontext(np)
    with context as xp:
        (wnet, whole), (pnet, part), (a, b) = _sliced_pair(xp, SLICE_CASES[case], layers)
        host = lambda x: np.array(backend.to_host(x))      # noqa: E731
        before = host(pnet.params)
        rng = np.random.default_rng(7)
        clipped = False
        for lr in (0.5, 2.0, 0.05, 4.0):
            g = rng.standard_normal(wnet.num_params).astype(np.float32)
            g[:a] = g[b:] = 0
            wnet.grads[...] = xp.asarray(g)
            g[:a] = g[b:] = np.nan
            pnet.grads[...] = xp.asarray(g)
            whole.step(lr)
            part.step(lr)
            clipped |= min(whole.last_scales) < 1 - whole.momentum
            np.testing.assert_array_equal(host(pnet.params)[a:b], host(wnet.params)[a:b])
            np.testing.assert_array_equal(host(pnet.params)[:a], before[:a])
            np.testing.assert_array_equal(host(pnet.params)[b:], before[b:])
        assert part.num_skipped == 0 and part.num_steps == 4
        if whole.delta is not None:
            np.testing.assert_array_equal(host(part.delta)[a:b], host(whole.delta)[a:b])
            assert not host(part.delta)[:a].any() and not host(part.delta)[b:].any()
        if SLICE_CASES[case].get("max_change", 2.0):
            assert clipped, "the step never reached a max-change"


def test_restrict_to_refuses_a_slice_that_cuts_a_layer():
    net = _net()
    opt = SGD(net)
    (_, first), (_, second) = net.param_slices[:2]
    with pytest.raises(ValueError, match="layer boundaries"):
        opt.restrict_to(0, first.stop + 1)
    with pytest.raises(ValueError, match="layer boundaries"):
        opt.restrict_to(first.start + 1, second.stop)
    opt.restrict_to(second.start, second.stop)
    assert opt.active == [1]


def _bounded_run(xp, optimizer_cls=SGD, **options):
    """One backward and step of a small net with nnet2's max-change-per-sample:
    (net, params before, the layers' tau from float64 rows, the gradients)."""
    from mpitrain import backend
    net = build_network(feat_dim=3, num_classes=5, left_context=1, right_context=1,
                        hidden_layers=2, hidden_dim=16, xp=xp)
    net.init_params(seed=2)
    rng = np.random.default_rng(3)
    # every layer random (the output layer starts at zero: no hidden gradient)
    net.params[...] = backend.to_device(
        rng.standard_normal(net.num_params).astype(np.float32) * 0.3, xp)
    x = rng.standard_normal((32, net.input_dim)).astype(np.float32) * 3
    labels = rng.integers(0, 5, 32)
    opt = optimizer_cls(net, max_change_per_layer=0, max_change_output=0, max_change=0,
                        minibatch=32, **options)
    net.forward_backward(backend.to_device(x, xp), backend.to_device(labels, xp))
    return net, opt


@pytest.mark.parametrize("device", ["host", "standin"])
def test_max_change_per_sample_bounds_each_layers_step_as_nnet2(device):
    """tau_c = sum_i ||[x_i, 1]|| ||g_i|| (the layer's rows and output derivative);
    where lr tau_c > m B the layer's step is scaled by m B / (lr tau_c), else left
    alone; so no layer moves more than m B.  On a device nothing is read back."""
    import contextlib

    from mpitrain import backend
    from mpitrain.testing import standin_cupy
    context = standin_cupy.installed() if device == "standin" else contextlib.nullcontext(np)
    with context as xp:
        net, opt = _bounded_run(xp, max_change_per_sample=0.07)
        affines = [layer for layer, _ in net.param_slices if layer.kind == "affine"]
        # (the bound itself is checked against float64 in the test below)
        taus = [float(backend.to_host(layer.step_bound)) for layer in affines]
        grads = np.float64(backend.to_host(net.grads)).copy()
        before = np.float64(backend.to_host(net.params)).copy()
        lr = 0.01
        if device == "standin":
            standin_cupy.reset_counts()
        opt.step(lr)
        if device == "standin":
            assert standin_cupy.READS == {"implicit": 0, "asnumpy": 0}
        change = np.float64(backend.to_host(net.params)) - before
        limit = 0.07 * 32
        clipped = 0
        for (layer, sl), tau in zip(net.param_slices, taus):
            scale = min(1.0, limit / (lr * tau))
            clipped += scale < 1
            np.testing.assert_allclose(change[sl], -lr * scale * grads[sl], rtol=2e-5,
                                       atol=1e-7)
            assert np.linalg.norm(change[sl]) <= limit * (1 + 1e-5)
        assert 0 < clipped < len(taus)          # both branches taken


def test_the_bound_is_the_sum_of_row_norm_products():
    net = build_network(feat_dim=3, num_classes=5, left_context=0, right_context=0,
                        hidden_layers=0, hidden_dim=4)
    net.init_params(seed=1)
    SGD(net, minibatch=8, max_change_per_sample=0.1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    labels = rng.integers(0, 5, 8)
    net.forward_backward(x, labels)
    layer = net.param_slices[0][0]
    rows = np.float64(np.hstack([x, np.ones((8, 1), np.float32)]))
    # the summed cross-entropy's derivative at the logits: softmax - one-hot
    logits = rows @ np.float64(layer.block).T
    dy = np.exp(logits - logits.max(axis=1, keepdims=True))
    dy /= dy.sum(axis=1, keepdims=True)
    dy[np.arange(8), labels] -= 1
    expected = float(np.linalg.norm(rows, axis=1) @ np.linalg.norm(dy, axis=1))
    assert float(layer.step_bound) == pytest.approx(expected, rel=1e-5)
    # its bound holds: ||dy^T rows|| <= sum_i ||rows_i|| ||dy_i||
    assert np.linalg.norm(np.float64(net.grads)) <= expected * (1 + 1e-6)


def test_max_change_per_sample_with_natural_gradient_keeps_every_layer_within_it():
    from mpitrain.optim.ngsgd import NaturalGradientSGD
    net, opt = _bounded_run(np, NaturalGradientSGD, rank_in=4, rank_out=4,
                            max_change_per_sample=0.02)
    before = net.params.copy()
    opt.step(0.05)
    for layer, sl in net.param_slices:
        assert np.linalg.norm(np.float64(net.params[sl]) - before[sl]) <= 0.02 * 32 * 1.0001
    assert not opt.static_step_ahead()


def test_max_change_per_sample_bounds_the_data_term_before_the_l2_term_is_added():
    """The module's order: a layer's gradient is scaled by the per-sample bound,
    then gains 2 l2 B w unscaled (the bound, from the rows, is of the data term)."""
    net, opt = _bounded_run(np, max_change_per_sample=1e-9, l2_regularize=0.01,
                            l2_regularize_output=0.01)
    before = np.float64(net.params).copy()
    lr = 0.01
    opt.step(lr)
    change = np.float64(net.params) - before
    # the data term is scaled by about 1e-9 * 32 / (lr tau): what is left is -lr 2 l2 B w
    np.testing.assert_allclose(change, -lr * 2 * 0.01 * 32 * before, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("change,named", [
    # (a forged checkpoint, its checksum recomputed: a float64 momentum of 1e300 turned
    # into infinity in the float32 buffer, and the next step made every weight NaN)
    (lambda s: dict(s, delta=np.full_like(s["delta"], 1e300, dtype=np.float64)),
     "field 'delta' (momentum): expected finite floats in [-3.40282e+38, 3.40282e+38]"),
    (lambda s: dict(s, delta=s["delta"][:3]), "field 'delta' (momentum): expected ("),
    (lambda s: dict(s, delta=s["delta"].astype(np.int32)), "field 'delta' (momentum)"),
    (lambda s: dict(s, adapt={"sum": -np.ones_like(s["adapt"]["sum"])}),
     "field 'adapt/sum': expected finite floats in [0, 3.40282e+38]"),
    (lambda s: dict(s, adapt={"sum": np.full(s["adapt"]["sum"].shape, 1e300)}),
     "field 'adapt/sum': expected finite floats in [0,"),
    (lambda s: dict(s, num_steps=2.5), "field 'num_steps': expected an int in [0,"),
    (lambda s: dict(s, num_skipped="3"), "field 'num_skipped': expected an int in [0,"),
])
def test_a_state_no_step_produces_is_refused_and_nothing_loaded(change, named):
    net = _net()
    opt = SGD(net, momentum=0.5,
              gradient_scaling=LimitedMemoryAdagrad(net.params, decay=0.9))
    _set_grads(net, [1.0] * len(net.param_slices))
    opt.step(0.01)
    state = opt.state_dict()
    fresh = SGD(net, momentum=0.5,
                gradient_scaling=LimitedMemoryAdagrad(net.params, decay=0.9))
    with pytest.raises(ValueError) as err:
        fresh.load_state_dict(change(state))
    assert named in str(err.value)
    assert not np.any(fresh.delta) and fresh.num_steps == 0
