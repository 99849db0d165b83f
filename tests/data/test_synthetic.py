"""The synthetic corpus: deterministic, well-formed, and a real learning problem.

Measured with this file's trainers on the corpus below (seed 1, 0.1 h train,
0.05 h dev; seeds 2 and 3 within 0.02):

    softmax regression, 1 frame      dev 0.19   (majority class 0.05)
    MLP 2x256, 1 frame               dev 0.31
    MLP 2x256, +-5 frames            dev 0.66   (train 0.86)

so a frame alone is ambiguous, context resolves much of it, and held-out
speakers stay well short of perfect.  The assertions keep wide margins.
"""

import os

import numpy as np
import pytest

from mpitrain.data.check import check_corpus
from mpitrain.data.corpus import load_manifest
from mpitrain.data.shards import ShardReader
from mpitrain.data.splice import frame_utterance_bounds, splice, splice_indices
from mpitrain.data.synthetic import FEAT_DIM, NUM_CLASSES, SyntheticParams, synthesize


def load_corpus(corpus_dir):
    """All frames of a corpus: feats (T, D), labels (T,), utterance offsets, ids, manifest."""
    manifest = load_manifest(corpus_dir)
    feats, labels, offsets, ids = [], [], [0], []
    for i in range(len(manifest.shards)):
        with ShardReader(manifest.shard_path(i)) as shard:
            f, l, o = shard.read(0, shard.num_utterances)
            feats.append(f)
            labels.append(l)
            offsets.extend((o[1:] + offsets[-1]).tolist())
            ids.extend(shard.utt_ids)
    return np.concatenate(feats), np.concatenate(labels), np.asarray(offsets), ids, manifest


def spliced_inputs(feats, offsets, context):
    start, end = frame_utterance_bounds(offsets)
    idx = splice_indices(np.arange(feats.shape[0]), start, end, context, context)
    return splice(feats, idx)


def train_classifier(x, y, hidden, *, epochs=5, lr=0.05, batch=256, seed=0):
    """Minibatch SGD with momentum on a ReLU MLP (hidden=[] is softmax regression).

    Returns a predict function.
    """
    rng = np.random.default_rng(seed)
    dims = [x.shape[1], *hidden, NUM_CLASSES]
    weights = [(rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
               for a, b in zip(dims[:-1], dims[1:])]
    biases = [np.zeros(b, np.float32) for b in dims[1:]]
    params = weights + biases
    velocity = [np.zeros_like(p) for p in params]
    steps_per_epoch = x.shape[0] // batch
    total, step = epochs * steps_per_epoch, 0
    for _ in range(epochs):
        order = rng.permutation(x.shape[0])
        for k in range(steps_per_epoch):
            rows = order[k * batch:(k + 1) * batch]
            acts = [x[rows]]
            for i, (w, b) in enumerate(zip(weights, biases)):
                z = acts[-1] @ w + b
                acts.append(np.maximum(z, 0) if i < len(weights) - 1 else z)
            logits = acts[-1] - acts[-1].max(axis=1, keepdims=True)
            grad = np.exp(logits)
            grad /= grad.sum(axis=1, keepdims=True)
            grad[np.arange(batch), y[rows]] -= 1
            grad /= batch
            grads_w, grads_b = [None] * len(weights), [None] * len(weights)
            for i in reversed(range(len(weights))):
                grads_w[i], grads_b[i] = acts[i].T @ grad, grad.sum(axis=0)
                if i:
                    grad = (grad @ weights[i].T) * (acts[i] > 0)
            rate = lr * (1 - step / total) + 1e-3
            step += 1
            for p, v, g in zip(params, velocity, grads_w + grads_b):
                v *= 0.9
                v -= rate * g
                p += v

    def predict(inputs):
        h = inputs
        for i, (w, b) in enumerate(zip(weights, biases)):
            h = h @ w + b
            if i < len(weights) - 1:
                h = np.maximum(h, 0)
        return h.argmax(axis=1)
    return predict


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synthetic"))
    info = synthesize(out, hours=0.1, speakers=40, shards=2, seed=1, dev_hours=0.05,
                      dev_speakers=8)
    return info


def test_corpus_is_well_formed(corpus):
    assert 36000 <= corpus["train_frames"] < 37000
    assert 18000 <= corpus["dev_frames"] < 19000
    for key in ("train_dir", "dev_dir"):
        assert check_corpus(corpus[key]) == []
        manifest = load_manifest(corpus[key])
        assert manifest.num_classes == NUM_CLASSES == 120
        assert manifest.feat_dim == FEAT_DIM == 40
        assert manifest.source["kind"] == "synthetic" and manifest.source["seed"] == 1
    feats, labels, _, _, manifest = load_corpus(corpus["train_dir"])
    assert labels.min() >= 0 and labels.max() < NUM_CLASSES
    assert len(manifest.shards) == 2
    # Nearly every state occurs in an hour's tenth; none dominates.
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    assert (counts > 0).sum() >= 110
    assert counts.max() / counts.sum() < 0.1


def test_dev_speakers_are_unseen_in_training(corpus):
    *_, train_ids, _ = load_corpus(corpus["train_dir"])
    *_, dev_ids, _ = load_corpus(corpus["dev_dir"])
    train_speakers = {u.split("-")[0] for u in train_ids}
    dev_speakers = {u.split("-")[0] for u in dev_ids}
    assert len(train_speakers) == 40 and len(dev_speakers) == 8
    assert not train_speakers & dev_speakers
    assert sorted(dev_speakers) == corpus["dev_speakers"]


def test_generation_is_deterministic(tmp_path):
    runs = []
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        out = str(tmp_path / name)
        synthesize(out, hours=0.01, speakers=4, shards=2, seed=seed, dev_hours=0.005,
                   dev_speakers=2)
        runs.append([load_corpus(os.path.join(out, split)) for split in ("train", "dev")])
    for split in range(2):
        first, again, other = (run[split] for run in runs)
        for k in range(4):
            np.testing.assert_array_equal(np.asarray(first[k]), np.asarray(again[k]))
        assert first[4].to_dict() == again[4].to_dict()
        assert first[0].shape != other[0].shape or not np.array_equal(first[0], other[0])


def test_params_are_validated():
    with pytest.raises(ValueError, match="num_bases"):
        SyntheticParams(num_bases=3)
    with pytest.raises(ValueError, match="hours"):
        synthesize("unused", hours=0)


@pytest.mark.parametrize("options,message", [
    # named as on the command line (`mpitrain synth` shows them), then as keywords
    ({"hours": float("inf")}, r"^--hours \(hours=\): must be a finite number"),
    ({"hours": float("nan")}, r"^--hours \(hours=\): must be a finite number"),
    ({"hours": 1e-9}, "--hours \\(hours=\\): must be a finite number of hours giving at "
                      "least 1 frame"),
    ({"dev_hours": 1e-9}, r"^--dev-hours \(dev_hours=\): must be"),
    ({"seen_dev_hours": -1.0}, r"^--seen-dev-hours \(seen_dev_hours=\): must be"),
    ({"seed": -1}, r"^--seed \(seed=\): must be an integer >= 0"),
    ({"shards": 0}, r"^--shards \(shards=\): expected a positive int, got 0$"),
    ({"dev_speakers": 0}, r"^--dev-speakers \(dev_speakers=\): expected a positive int"),
    ({"speakers": 100_000, "hours": 0.01},
     "^--speakers 100000: --hours 0.01 gives 3600 frames, under 100 a speaker; give more "
     "--hours or fewer --speakers$"),
    ({"dev_speakers": 100_000, "dev_hours": 0.01},
     "^--dev-speakers 100000: --dev-hours 0.01 gives 3600 frames"),
    # (each written empty, minutes of it with 100,000)
    ({"shards": 500, "hours": 0.01}, "^--shards 500: --hours 0.01 gives at most 120 utterance"
                                     r"\(s\), and a shard holds whole utterances; give fewer "
                                     "--shards or more --hours$"),
])
def test_impossible_amounts_are_refused_before_anything_is_written(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        synthesize(str(tmp_path / "out"), **options)
    assert not (tmp_path / "out").exists()


def test_context_dnn_beats_single_frame_models_by_a_wide_margin(corpus):
    train_feats, train_labels, train_offsets, _, manifest = load_corpus(corpus["train_dir"])
    dev_feats, dev_labels, dev_offsets, _, _ = load_corpus(corpus["dev_dir"])
    mean = np.asarray(manifest.cmvn_mean, np.float32)
    std = np.sqrt(np.asarray(manifest.cmvn_var, np.float32))
    train_feats = (train_feats - mean) / std
    dev_feats = (dev_feats - mean) / std
    majority = np.bincount(dev_labels).max() / dev_labels.size

    def dev_accuracy(context, hidden):
        predict = train_classifier(spliced_inputs(train_feats, train_offsets, context),
                                   train_labels, hidden)
        return float((predict(spliced_inputs(dev_feats, dev_offsets, context))
                      == dev_labels).mean())

    linear_1 = dev_accuracy(0, [])
    mlp_1 = dev_accuracy(0, [256, 256])
    mlp_11 = dev_accuracy(5, [256, 256])
    summary = f"majority {majority:.3f} linear {linear_1:.3f} mlp {mlp_1:.3f} mlp+-5 {mlp_11:.3f}"
    assert linear_1 > 2 * majority, summary
    assert mlp_11 >= linear_1 + 0.30, summary          # measured +0.46
    assert mlp_11 >= mlp_1 + 0.20, summary             # context: measured +0.34
    assert 0.5 <= mlp_11 <= 0.9, summary               # learnable, not trivial


def test_shards_left_empty_are_warned_of(tmp_path, capsys):
    # (an amount that fits more than the utterances written wrote the rest of the
    # shards empty without a word; prepare warns of them)
    from mpitrain.cli import main
    out = tmp_path / "s"
    assert main(["synth", str(out), "--hours", "0.001", "--speakers", "1", "--shards", "8",
                 "--dev-hours", "0.0005", "--dev-speakers", "1"]) == 0
    said = capsys.readouterr()
    err = said.err
    # (one of each was counted as `1 utterances, 1 speakers`, `1 unseen speakers`)
    assert "1 utterance, 1 speaker\n" in said.out and " 1 unseen speaker\n" in said.out
    assert err == (f"mpitrain synth: warning: {out / 'train'}: 7 of 8 shards hold no "
                   "utterance (1 written); --shards 1 or fewer leaves none empty\n")
    assert synthesize(str(tmp_path / "t"), hours=0.002, speakers=2, shards=2,
                      dev_hours=0.0005, dev_speakers=1)["warnings"] == []


def test_synth_errors_name_the_command_line_options(tmp_path, capsys):
    # (they named the Python keywords: `shards must be a positive int`, `overwrite=True`)
    from mpitrain.cli import main
    out = tmp_path / "s"
    assert main(["synth", str(out), "--shards", "0"]) == 2
    assert capsys.readouterr().err == ("mpitrain synth: error: --shards (shards=): expected "
                                       "a positive int, got 0\n")
    assert main(["synth", str(out), "--dev-hours", "-1"]) == 2
    assert capsys.readouterr().err.startswith("mpitrain synth: error: --dev-hours "
                                              "(dev_hours=): must be a finite number")
    small = ["--hours", "0.001", "--speakers", "1", "--shards", "1", "--dev-hours", "0.0005",
             "--dev-speakers", "1"]
    assert main(["synth", str(out), *small]) == 0
    capsys.readouterr()
    assert main(["synth", str(out), *small]) == 2
    assert capsys.readouterr().err.endswith(": a corpus already exists here; choose another "
                                            "directory or pass --overwrite (overwrite=True)\n")
    assert main(["synth", str(out), *small, "--overwrite"]) == 0
