"""The synthetic corpus's optional held-out split of the training speakers (dev_seen)."""

import os

import numpy as np
import pytest

from mpitrain.data.check import check_corpus
from mpitrain.data.synthetic import synthesize

from .test_synthetic import load_corpus

SMALL = dict(hours=0.02, speakers=4, shards=2, dev_hours=0.005, dev_speakers=2, seed=5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("seen") / "corpus")
    return synthesize(out, seen_dev_hours=0.01, **SMALL)


def test_seen_dev_split_has_the_training_speakers(corpus):
    seen_dir = corpus["seen_dev_dir"]
    assert os.path.basename(seen_dir) == "dev_seen"
    assert os.path.dirname(seen_dir) == os.path.dirname(corpus["train_dir"])
    assert check_corpus(seen_dir) == []
    assert corpus["seen_dev_speakers"] == corpus["train_speakers"]
    assert not set(corpus["seen_dev_speakers"]) & set(corpus["dev_speakers"])
    feats, labels, _, ids, manifest = load_corpus(seen_dir)
    assert manifest.num_classes == 120 and len(labels) == corpus["seen_dev_frames"]
    assert len(labels) >= 0.01 * 3600 * 100
    assert {i.split("-")[0] for i in ids} == set(corpus["train_speakers"])
    train_ids = set(load_corpus(corpus["train_dir"])[3])
    assert not set(ids) & train_ids


def test_seen_dev_frames_differ_from_training(corpus):
    seen = load_corpus(corpus["seen_dev_dir"])[0]
    train = load_corpus(corpus["train_dir"])[0]
    n = min(len(seen), len(train))
    assert not np.allclose(seen[:n], train[:n])
    # not one frame of dev_seen repeats a training frame
    train_rows = {row.tobytes() for row in train}
    assert sum(row.tobytes() in train_rows for row in seen) == 0


def test_seen_dev_is_deterministic_and_leaves_train_and_dev_alone(corpus, tmp_path):
    again = synthesize(str(tmp_path / "again"), seen_dev_hours=0.01, **SMALL)
    plain = synthesize(str(tmp_path / "plain"), **SMALL)
    assert "seen_dev_dir" not in plain
    assert not os.path.exists(os.path.join(str(tmp_path / "plain"), "dev_seen"))
    for split in ("seen_dev_dir", "train_dir", "dev_dir"):
        a, b = load_corpus(corpus[split]), load_corpus(again[split])
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[3] == b[3]
    for split in ("train_dir", "dev_dir"):
        a, b = load_corpus(corpus[split]), load_corpus(plain[split])
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[3] == b[3]


def test_a_seen_dev_set_of_less_than_a_frame_is_refused_before_anything_is_written(tmp_path):
    # train and dev were written, then the empty seen set failed: a rerun then met
    # 'a corpus already exists'
    import pytest
    with pytest.raises(ValueError, match=r"--seen-dev-hours \(seen_dev_hours=\): must be a "
                                         r"finite number of hours giving at least 1 frame "
                                         r"\(100 frames/s\) or 0"):
        synthesize(str(tmp_path / "s"), seen_dev_hours=1e-7, **SMALL)
    assert not (tmp_path / "s").exists()
