"""L2 regularization (optim/sgd.py): the step adds 2 l2_c B w_c to each layer's summed
gradient, the output layer with its own l2, after the natural gradient and before
max-change, once however the ranks combine their gradients."""

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.config import OptimizerConfig
from mpitrain.nn.network import build_network
from mpitrain.optim.factory import build_optimizer
from mpitrain.optim.sgd import SGD

B = 32


def _net(xp):
    net = build_network(feat_dim=5, num_classes=4, left_context=1, right_context=1,
                        hidden_layers=2, hidden_dim=6, xp=xp)
    net.init_params(seed=1)
    net.params[...] = backend.to_device(
        np.random.default_rng(3).normal(0, 0.3, net.num_params).astype(np.float32), xp)
    return net


def _batch(net, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, net.input_dim)).astype(np.float32)
    return backend.to_device(x, net.xp), backend.to_device(rng.integers(0, 4, size=B), net.xp)


@pytest.mark.parametrize("optimizer", ["sgd", "ngsgd"])
def test_l2_adds_two_l2_b_w_to_each_layers_gradient(xp, optimizer):
    l2_hidden, l2_output, lr = 1e-3, 4e-3, 0.01
    plain_net, reg_net = _net(xp), _net(xp)
    off = dict(max_change_per_layer=0.0, max_change_output=0.0, max_change=0.0)
    plain = build_optimizer(OptimizerConfig(name=optimizer, **off), plain_net)
    reg = build_optimizer(OptimizerConfig(name=optimizer, l2_regularize=l2_hidden,
                                          l2_regularize_output=l2_output, **off), reg_net,
                          minibatch=B)
    x, labels = _batch(plain_net)
    before = backend.to_host(plain_net.params).astype(np.float64)
    for net, opt in ((plain_net, plain), (reg_net, reg)):
        net.forward_backward(x, labels)
        opt.step(lr)
    # the same data step (NG-SGD preconditions only the data term), plus lr 2 l2 B w
    expected = backend.to_host(plain_net.params).astype(np.float64)
    slices = [sl for _, sl in reg_net.param_slices]
    for i, sl in enumerate(slices):
        l2 = l2_output if i == len(slices) - 1 else l2_hidden
        expected[sl] -= lr * 2 * l2 * B * before[sl]
    assert np.allclose(backend.to_host(reg_net.params), expected, rtol=1e-5, atol=1e-7)


def test_l2_alone_shrinks_the_weights_geometrically():
    net = _net(np)
    opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0,
              l2_regularize=1e-3, l2_regularize_output=0.0, minibatch=B)
    before = net.params.copy()
    for _ in range(5):
        net.grads[...] = 0            # no data term: w <- (1 - 2 lr l2 B) w
        opt.step(0.1)
    slices = [sl for _, sl in net.param_slices]
    shrink = (1 - 2 * 0.1 * 1e-3 * B) ** 5
    for sl in slices[:-1]:
        assert np.allclose(net.params[sl], before[sl] * shrink, rtol=1e-5)
    assert np.array_equal(net.params[slices[-1]], before[slices[-1]])   # output: l2 0


def test_l2_term_is_limited_by_max_change():
    net = _net(np)
    opt = SGD(net, max_change_per_layer=1e-3, max_change_output=1e-3, max_change=0,
              l2_regularize=10.0, l2_regularize_output=10.0, minibatch=B)
    before = net.params.copy()
    net.grads[...] = 0
    opt.step(1.0)
    for _, sl in net.param_slices:
        assert np.linalg.norm(net.params[sl] - before[sl]) == pytest.approx(1e-3, rel=1e-4)


def test_l2_counts_once_when_ranks_average_gradients():
    """Two ranks averaging their gradients take the step one rank takes on the
    average gradient: the L2 term is not multiplied by the number of ranks."""
    nets = [_net(np) for _ in range(3)]
    opts = [SGD(n, l2_regularize=2e-3, l2_regularize_output=2e-3, minibatch=B) for n in nets]
    (x0, y0), (x1, y1) = _batch(nets[0], 0), _batch(nets[0], 1)
    nets[0].forward_backward(x0, y0)
    nets[1].forward_backward(x1, y1)
    mean = (nets[0].grads + nets[1].grads) / 2          # what allreduce(op="mean") leaves
    for net in nets:
        net.grads[...] = mean
    for net, opt in zip(nets, opts):
        opt.step(0.05)
    assert np.array_equal(nets[0].params, nets[1].params)
    assert np.array_equal(nets[0].params, nets[2].params)


def test_l2_needs_the_minibatch_and_a_non_negative_value():
    net = _net(np)
    with pytest.raises(ValueError, match="minibatch"):
        SGD(net, l2_regularize=1e-4)
    with pytest.raises(ValueError, match=">= 0"):
        SGD(net, l2_regularize=-1e-4, minibatch=B)


def test_kaldi_jobs_at_j_times_the_rate_shrink_the_weights_as_one_model_at_the_rate():
    """Kaldi averages J jobs trained at J lr and scales the L2 term by 1/J
    (l2_regularize_factor): per step the weights shrink by 2 lr l2 B, not J times that."""
    from types import SimpleNamespace
    from mpitrain.parallel.kaldi_averaging import KaldiAveraging
    strategy = KaldiAveraging(SimpleNamespace(rank=0, size=4), every_steps=2, total_steps=8,
                              jobs_initial=1, jobs_final=4)
    assert [strategy.num_jobs(s) for s in range(8)] == [1, 1, 2, 2, 3, 3, 3, 3]
    net = _net(np)
    opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0,
              l2_regularize=1e-3, l2_regularize_output=1e-3, minibatch=B)
    before = net.params.copy()
    for step in range(8):
        net.grads[...] = 0            # no data term: only the L2 shrink
        opt.set_l2_factor(strategy.l2_factor(step))
        opt.step(strategy.learning_rate(0.1, step))
    assert opt.l2_factor == pytest.approx(1 / 3)
    np.testing.assert_allclose(net.params, before * (1 - 2 * 0.1 * 1e-3 * B) ** 8, rtol=1e-5)


def test_the_training_step_hands_the_strategys_l2_factor_to_the_optimizer():
    from mpitrain.comm.single import SingleCommunicator
    from mpitrain.parallel.base import Strategy
    from mpitrain.train.step import TrainingStep

    class ThreeJobs(Strategy):
        def l2_factor(self, step=0):
            return 1 / 3
    net = _net(np)
    opt = SGD(net, l2_regularize=1e-3, minibatch=B)
    step = TrainingStep(net, opt, ThreeJobs(SingleCommunicator()), minibatch=B,
                        left_context=1, right_context=1)

    class Chunk:
        feats = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
        labels = np.zeros(64, dtype=np.int32)
        utt_start, utt_end = np.zeros(64, dtype=np.int64), np.full(64, 64, dtype=np.int64)
    step.run(0, 0.01, lambda: (Chunk, np.arange(B)))
    assert opt.l2_factor == pytest.approx(1 / 3)
