"""Dropout (nn/dropout.py, nn/network.py): Kaldi's schedule syntax, masks with the
right proportion and scale that depend only on (seed, rank, step, layer), gradients
that match finite differences under a fixed mask, and evaluation that never drops."""

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.nn.dropout import (DropoutMasks, DropoutSchedule, dropout_key,
                                 parse_dropout_schedule)
from mpitrain.nn.network import build_network


@pytest.mark.parametrize("text, points", [
    ("0.2", [(0.0, 0.2), (1.0, 0.2)]),
    ("0,0.2@0.5,0", [(0.0, 0.0), (0.5, 0.2), (1.0, 0.0)]),
    ("0,0.1,0.3,0", [(0.0, 0.0), (1 / 3, 0.1), (2 / 3, 0.3), (1.0, 0.0)]),
    ("0@0,0.5@0.2,0.5@0.8,0@1", [(0.0, 0.0), (0.2, 0.5), (0.8, 0.5), (1.0, 0.0)]),
])
def test_schedule_parses_kaldi_form(text, points):
    got = parse_dropout_schedule(text)
    assert [f for f, _ in got] == pytest.approx([f for f, _ in points])
    assert [v for _, v in got] == pytest.approx([v for _, v in points])


@pytest.mark.parametrize("text", ["", "0,,0", "a", "1.0", "-0.1", "0,0.2@0.7,0.1@0.5,0",
                                  "0@0.3,0.1", "0.1,0@0.5", "0,0.2@1.5,0"])
def test_schedule_rejects_bad_text(text):
    with pytest.raises(ValueError):
        parse_dropout_schedule(text)


def test_schedule_interpolates_linearly():
    schedule = DropoutSchedule("0,0.2@0.5,0")
    assert [schedule.proportion(f) for f in (0.0, 0.25, 0.5, 0.75, 1.0, 2.0)] == \
        pytest.approx([0.0, 0.1, 0.2, 0.1, 0.0, 0.0])
    assert schedule.active and not DropoutSchedule("0").active
    assert schedule.rises and not DropoutSchedule("0.3,0.1@0.5,0").rises
    assert schedule.last_rise_end == 0.5
    assert DropoutSchedule("0,0@0.2,0.3@0.4,0.2@0.6,0.5@0.8,0").last_rise_end == 0.8


def test_schedule_never_leaves_the_range_of_its_points():
    # ('0,0.2@0.6,0' gave -2.8e-17 at the end of training: the masks refused it
    # and a run failed at its last step, without a final model)
    schedule = DropoutSchedule("0,0.2@0.6,0")
    assert schedule.proportion(1.0) == 0.0
    for text in ("0,0.2@0.6,0", "0,0.3@0.7,0", "0.1,0.7@0.3,0.1", "0,0.2@0.1,0.6@0.9,0"):
        schedule = DropoutSchedule(text)
        values = [v for _, v in schedule.points]
        for f in np.linspace(0.0, 1.0, 10001):
            p = schedule.proportion(f)
            assert min(values) <= p <= max(values), (text, f, p)
        DropoutMasks(seed=1).draw(step=1, proportion=schedule.proportion(1.0))


def test_masks_drop_the_proportion_and_keep_the_expectation(xp):
    masks = DropoutMasks(seed=3, rank=1)
    masks.draw(step=17, proportion=0.3)
    m = backend.to_host(masks.mask(0, (512, 256), xp, np.float32))
    assert set(np.unique(m)) == {0.0, np.float32(1 / 0.7)}
    assert abs((m == 0).mean() - 0.3) < 0.01         # 131k draws: sd 0.0013
    assert abs(m.mean() - 1.0) < 0.02
    # no structure along rows or columns
    assert np.abs((m == 0).mean(axis=0) - 0.3).max() < 0.15
    assert np.abs((m == 0).mean(axis=1) - 0.3).max() < 0.15


def test_masks_depend_only_on_seed_rank_step_and_layer():
    def mask(seed, rank, step, layer):
        masks = DropoutMasks(seed=seed, rank=rank)
        masks.draw(step=step, proportion=0.5)
        return masks.mask(layer, (64, 128), np, np.float32).copy()

    base = mask(1, 0, 5, 0)
    assert np.array_equal(base, mask(1, 0, 5, 0))
    for other in (mask(2, 0, 5, 0), mask(1, 1, 5, 0), mask(1, 0, 6, 0), mask(1, 0, 5, 1)):
        agree = (base == other).mean()
        assert 0.4 < agree < 0.6                     # independent halves agree half the time
    assert len({dropout_key(1, r, s, l) for r in range(4) for s in range(50)
                for l in range(5)}) == 1000


def test_masks_are_the_same_on_every_array_module(xp):
    host, device = DropoutMasks(seed=9), DropoutMasks(seed=9)
    host.draw(step=3, proportion=0.25)
    device.draw(step=3, proportion=0.25)
    assert np.array_equal(host.mask(2, (33, 70), np, np.float32),
                          backend.to_host(device.mask(2, (33, 70), xp, np.float32)))


def _net(xp, nonlinearity="relu"):
    net = build_network(feat_dim=6, num_classes=5, left_context=1, right_context=1,
                        hidden_layers=2, hidden_dim=8, nonlinearity=nonlinearity, xp=xp,
                        pnorm_output_dim=4)
    net.init_params(seed=2)
    # a non-zero output layer, so every layer's gradient is non-zero
    net.params[...] = backend.to_device(
        np.random.default_rng(0).normal(0, 0.5, net.num_params).astype(np.float32), xp)
    return net


@pytest.mark.parametrize("nonlinearity", ["relu", "sigmoid", "pnorm"])
def test_gradient_with_dropout_matches_finite_differences(nonlinearity):
    net = _net(np, nonlinearity)
    net.params[...] = net.params.astype(np.float64).astype(np.float32)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, net.input_dim)).astype(np.float32)
    labels = rng.integers(0, 5, size=16)
    net.dropout = DropoutMasks(seed=4)
    net.dropout.draw(step=2, proportion=0.4)
    net.forward_backward(x, labels)
    analytic = net.grads.astype(np.float64).copy()

    def loss(params):
        saved = net.params.copy()
        net.params[...] = params
        total = net.forward_backward(x, labels)[0]     # same step: same masks
        net.params[...] = saved
        return float(total)

    base = net.params.copy()
    eps = 1e-2
    for i in rng.choice(net.num_params, size=40, replace=False):
        up, down = base.copy(), base.copy()
        up[i] += eps
        down[i] -= eps
        numeric = (loss(up) - loss(down)) / (2 * eps)
        assert numeric == pytest.approx(analytic[i], rel=0.05, abs=2e-3)


def test_dropout_changes_training_passes_only(xp):
    net = _net(xp)
    rng = np.random.default_rng(5)
    x = backend.to_device(rng.normal(size=(32, net.input_dim)).astype(np.float32), xp)
    labels = backend.to_device(rng.integers(0, 5, size=32), xp)
    plain_eval = backend.to_host(net.evaluate_batch(x, labels)[0])
    net.forward_backward(x, labels)
    plain_grads = backend.to_host(net.grads).copy()

    net.dropout = DropoutMasks(seed=1)
    net.dropout.draw(step=0, proportion=0.0)          # proportion 0: bit for bit as without
    net.forward_backward(x, labels)
    assert np.array_equal(backend.to_host(net.grads), plain_grads)

    net.dropout.draw(step=0, proportion=0.5)
    net.forward_backward(x, labels)
    assert not np.allclose(backend.to_host(net.grads), plain_grads)
    assert backend.to_host(net.evaluate_batch(x, labels)[0]) == plain_eval
    net.forward_backward(x, labels, dropout=False)     # the combiner's gradient pass
    assert np.allclose(backend.to_host(net.grads), plain_grads, rtol=1e-5, atol=1e-7)
