"""Held-out evaluation: a frame cap scores the first frames exactly as uncut."""

import os

import numpy as np
import pytest

from mpitrain.data.corpus import load_manifest
from mpitrain.nn.network import build_network
from mpitrain.train.evaluate import evaluate_chunks, load_eval_chunks


def _network(manifest, context):
    net = build_network(feat_dim=manifest.feat_dim, num_classes=manifest.num_classes,
                        left_context=context, right_context=context, hidden_layers=1,
                        hidden_dim=16)
    # random weights everywhere (the output layer starts at zero): inputs change outputs
    net.params[...] = np.random.default_rng(2).standard_normal(net.num_params) * 0.3
    net.set_cmvn(manifest.cmvn_mean, manifest.cmvn_var)
    return net


@pytest.mark.parametrize("context", [0, 4])
def test_a_cap_inside_an_utterance_keeps_the_right_context_of_the_last_frames(small_corpus,
                                                                             context):
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    net = _network(dev, context)
    whole = load_eval_chunks(dev, net)
    feats, labels, start, end = whole[0]
    cap = int(end[0]) - 2          # two frames before the first utterance ends
    # the first `cap` frames scored with the whole utterance around them
    expected = evaluate_chunks(net, [(feats, labels[:cap], start[:cap], end[:cap])])
    capped = load_eval_chunks(dev, net, max_frames=cap)
    assert sum(len(c[1]) for c in capped) == cap
    assert evaluate_chunks(net, capped) == pytest.approx(expected, rel=1e-12)


def test_a_negative_cap_is_refused(small_corpus):
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    with pytest.raises(ValueError, match="max_frames must be >= 0"):
        load_eval_chunks(dev, _network(dev, 1), max_frames=-1)
