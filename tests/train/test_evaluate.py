"""Held-out evaluation: a frame cap scores the first frames exactly as uncut."""

import os

import numpy as np
import pytest

from mpitrain.data.corpus import load_manifest
from mpitrain.nn.network import build_network
from mpitrain.train.evaluate import evaluate_chunks, iter_eval_chunks, load_eval_chunks


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


@pytest.mark.parametrize("cap", [1, 3, 1001])
def test_the_ranks_parts_of_a_cap_add_up_to_it(small_corpus, cap):
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    net = _network(dev, 1)
    taken = [sum(len(c[1]) for c in load_eval_chunks(dev, net, rank=r, size=4, max_frames=cap))
             for r in range(4)]
    assert sum(taken) == cap


def test_a_set_smaller_than_the_ranks_is_capped_on_rank_0_alone(small_corpus, tmp_path):
    from mpitrain.data.synthetic import synthesize
    synthesize(str(tmp_path / "c"), hours=0.00001, speakers=1, shards=1, dev_hours=0.001,
               dev_speakers=1)
    dev = load_manifest(str(tmp_path / "c" / "dev"))
    assert dev.num_utterances < 8
    net = _network(dev, 1)
    taken = [sum(len(c[1]) for c in load_eval_chunks(dev, net, rank=r, size=8, max_frames=100))
             for r in range(8)]
    assert taken == [100] + [0] * 7


def test_chunks_of_many_sizes_leave_no_buffers_of_their_sizes(small_corpus):
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    net = _network(dev, 2)
    feats, labels, start, end = load_eval_chunks(dev, net)[0]
    evaluate_chunks(net, [(feats, labels[:50], start[:50], end[:50])])
    held = sum(len(c._buffers.keys()) for c in net.components if hasattr(c, "_buffers"))
    for n in range(51, 70):          # each chunk's last batch a size of its own
        evaluate_chunks(net, [(feats, labels[:n], start[:n], np.minimum(end[:n], n))])
    assert sum(len(c._buffers.keys()) for c in net.components
               if hasattr(c, "_buffers")) == held


@pytest.mark.parametrize("cap", [0, 1500])
def test_chunks_read_one_at_a_time_are_those_loaded_at_once(small_corpus, cap):
    train = load_manifest(os.path.join(small_corpus, "train"))
    net = _network(train, 2)
    loaded = load_eval_chunks(train, net, rank=1, size=2, max_frames=cap)
    streamed = iter_eval_chunks(train, net, rank=1, size=2, max_frames=cap)
    assert not isinstance(streamed, (list, tuple))        # read as they are taken
    streamed = list(streamed)
    assert len(streamed) == len(loaded)
    for got, expected in zip(streamed, loaded):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="max_frames must be >= 0"):
        iter_eval_chunks(train, net, max_frames=-1)       # refused before any read


@pytest.mark.parametrize("corpus, cap", [("dev", 3000), ("train", 20_000), ("train", 250)])
def test_a_cap_scores_the_same_first_frames_on_any_number_of_ranks(small_corpus, corpus, cap):
    # as `eval --max-frames` (one process) scores them: each rank's first frames made
    # another subset for every rank count
    manifest = load_manifest(os.path.join(small_corpus, corpus))
    net = _network(manifest, 2)
    alone = evaluate_chunks(net, load_eval_chunks(manifest, net, max_frames=cap))
    assert alone[2] == cap
    for size in (2, 3, 5):
        parts = [evaluate_chunks(net, load_eval_chunks(manifest, net, rank=r, size=size,
                                                       max_frames=cap)) for r in range(size)]
        total, correct, frames = (sum(p[k] for p in parts) for k in range(3))
        assert (correct, frames) == (alone[1], cap)
        assert total == pytest.approx(alone[0], rel=1e-6)     # float32 sums
