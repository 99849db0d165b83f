"""``model.init_from`` (train/pretrained_init.py): the network starts from the function
the RBM stack computes on the input normalisation it was pretrained with."""

from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.nn.network import build_network
from mpitrain.nn.rbm import RBM, UNRECORDED, RBMStack
from mpitrain.nn.rbm_file import load_rbm_stack, save_rbm_stack
from mpitrain.train.pretrained_init import init_from_pretrained

FEAT, LEFT, RIGHT, HIDDEN = 6, 2, 1, 5
WIDTH = LEFT + 1 + RIGHT


def _stack(path, mean, scale, **kw):
    rng = np.random.default_rng(3)
    rbms = [RBM(FEAT * WIDTH, HIDDEN, visible="gaussian"), RBM(HIDDEN, HIDDEN)]
    for rbm in rbms:
        rbm.params[...] = rng.standard_normal(rbm.num_params).astype(np.float32) * 0.3
    stack = RBMStack(rbms, feat_dim=FEAT, left_context=LEFT, right_context=RIGHT,
                     cmvn_mean=mean, cmvn_scale=scale, **kw)
    save_rbm_stack(str(path), stack)
    return stack


def _network(mean, var):
    net = build_network(feat_dim=FEAT, num_classes=4, left_context=LEFT, right_context=RIGHT,
                        hidden_layers=2, hidden_dim=HIDDEN, nonlinearity="sigmoid")
    net.init_params(seed=1)
    net.set_cmvn(mean, var)
    return net


def _first_layer(net, stack, frames):
    """(network's first pre-activation on its normalisation, the stack's on its own)."""
    net_in = ((frames - net.cmvn_mean) * net.cmvn_scale).reshape(len(frames), -1)
    stack_in = ((frames - stack.cmvn_mean) * stack.cmvn_scale).reshape(len(frames), -1)
    layer, rbm = net.affine_layers()[0], stack.rbms[0]
    ours = net_in.astype(np.float64) @ layer.weight.T.astype(np.float64) + layer.bias
    theirs = stack_in.astype(np.float64) @ rbm.weight.T.astype(np.float64) + rbm.hidden_bias
    return ours, theirs


def test_a_stack_pretrained_on_other_statistics_gives_its_own_outputs(tmp_path):
    rng = np.random.default_rng(0)
    corpus_mean, corpus_var = rng.normal(size=FEAT) * 3, rng.uniform(0.5, 4.0, FEAT)
    stack = _stack(tmp_path / "pre.h5", mean=rng.normal(size=FEAT) * 3,
                   scale=rng.uniform(0.3, 1.5, FEAT))
    net = _network(corpus_mean, corpus_var)
    assert init_from_pretrained(net, SimpleNamespace(model=SimpleNamespace(
        init_from=str(tmp_path / "pre.h5"))))
    # raw frames (T, context, feat): the first layer computes what the stack's did
    frames = (rng.normal(size=(50, WIDTH, FEAT)) * 2 + corpus_mean).astype(np.float32)
    ours, theirs = _first_layer(net, stack, frames)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    # the layers above are the stack's as they are; the model keeps the corpus's CMVN
    np.testing.assert_array_equal(net.affine_layers()[1].block, stack.rbms[1].block)
    np.testing.assert_allclose(net.cmvn_mean, corpus_mean.astype(np.float32))


def test_a_stack_pretrained_on_the_same_statistics_is_copied_as_it_is(tmp_path):
    rng = np.random.default_rng(0)
    mean, var = rng.normal(size=FEAT), rng.uniform(0.5, 4.0, FEAT)
    net = _network(mean, var)
    stack = _stack(tmp_path / "pre.h5", mean=net.cmvn_mean, scale=net.cmvn_scale)
    assert not init_from_pretrained(net, SimpleNamespace(model=SimpleNamespace(
        init_from=str(tmp_path / "pre.h5"))))
    for layer, rbm in zip(net.affine_layers(), stack.rbms):
        np.testing.assert_array_equal(layer.block, rbm.block)


@pytest.mark.parametrize("field", ["mean", "scale"])
def test_the_stacks_statistics_are_not_those_of_the_corpus_unnoticed(tmp_path, field):
    rng = np.random.default_rng(0)
    net = _network(rng.normal(size=FEAT), rng.uniform(0.5, 4.0, FEAT))
    mean, scale = net.cmvn_mean.copy(), net.cmvn_scale.copy()
    (mean if field == "mean" else scale)[2] *= 1.5
    stack = _stack(tmp_path / "pre.h5", mean=mean, scale=scale)
    assert init_from_pretrained(net, SimpleNamespace(model=SimpleNamespace(
        init_from=str(tmp_path / "pre.h5"))))
    ours, theirs = _first_layer(net, stack, rng.normal(size=(20, WIDTH, FEAT)).astype(np.float32))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stack_cmvn,corpus_cmvn,refused", [
    (None, {"norm_vars": True}, "no per-speaker CMVN, but the training corpus has "
                                "per-speaker CMVN, norm_vars true"),
    ({"norm_vars": False}, None, "per-speaker CMVN, norm_vars false, but the training "
                                 "corpus has no per-speaker CMVN"),
    ({"norm_vars": False}, {"norm_vars": True}, "norm_vars false, but the training corpus "
                                                "has per-speaker CMVN, norm_vars true"),
    ({"norm_vars": True}, {"norm_vars": True}, None),
    (None, None, None),
    (UNRECORDED, {"norm_vars": True}, None),        # a file older than the record
], ids=["none-vs-speaker", "speaker-vs-none", "means-vs-vars", "alike", "neither", "old-file"])
def test_a_stack_pretrained_with_other_per_speaker_cmvn_is_refused(tmp_path, stack_cmvn,
                                                                  corpus_cmvn, refused):
    # features normalised per speaker are another input: no rescaling maps them
    rng = np.random.default_rng(0)
    net = _network(rng.normal(size=FEAT), rng.uniform(0.5, 4.0, FEAT))
    net.speaker_cmvn = corpus_cmvn
    _stack(tmp_path / "pre.h5", mean=net.cmvn_mean, scale=net.cmvn_scale,
           speaker_cmvn=stack_cmvn)
    assert load_rbm_stack(str(tmp_path / "pre.h5")).speaker_cmvn == stack_cmvn
    cfg = SimpleNamespace(model=SimpleNamespace(init_from=str(tmp_path / "pre.h5")))
    if refused is None:
        init_from_pretrained(net, cfg)
        return
    with pytest.raises(ValueError) as info:
        init_from_pretrained(net, cfg)
    assert str(info.value).startswith(f"model.init_from: {tmp_path / 'pre.h5'}: the stack was "
                                      "pretrained on features with "), info.value
    assert refused in str(info.value) and "pretrain on a corpus prepared alike" in str(info.value)
