"""check_corpus: a sound corpus passes, each kind of damage is named precisely."""

import os

import h5py
import numpy as np
import pytest
import yaml

from mpitrain.data import check as check_module
from mpitrain.data.check import check_corpus
from mpitrain.data.corpus import manifest_path
from mpitrain.data.writer import CorpusWriter


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    out = str(tmp_path / "corpus")
    with CorpusWriter(out, feat_dim=4, num_classes=6, num_shards=2) as writer:
        for i in range(12):
            t = int(rng.integers(5, 30))
            writer.add(f"utt{i}", rng.normal(size=(t, 4)).astype(np.float32),
                       rng.integers(0, 6, t))
    return out


def shard(corpus, i=0):
    return os.path.join(corpus, f"shard-{i:05d}.h5")


def one_problem_naming(problems, *parts):
    assert problems, "expected a problem"
    assert any(all(p in msg for p in parts) for msg in problems), problems


def test_a_sound_corpus_has_no_problems(corpus, monkeypatch):
    assert check_corpus(corpus) == []
    # Scanning in many small blocks gives the same verdict (and the same statistics).
    monkeypatch.setattr(check_module, "_BLOCK_FRAMES", 7)
    assert check_corpus(corpus) == []


def test_label_out_of_range(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"][3] = 6
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "dataset 'labels'", "outside [0, 6)",
                       "is 6 at frame 3")


def test_nan_in_features(corpus, monkeypatch):
    monkeypatch.setattr(check_module, "_BLOCK_FRAMES", 5)
    with h5py.File(shard(corpus, 1), "a") as f:
        f["feats"][17, 2] = np.nan
    one_problem_naming(check_corpus(corpus), shard(corpus, 1), "dataset 'feats'", "NaN",
                       "frame 17")


def test_missing_shard_file(corpus):
    os.remove(shard(corpus, 1))
    one_problem_naming(check_corpus(corpus), shard(corpus, 1), "missing", "shards[1].path")


def test_truncated_dataset(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"].resize(f["labels"].shape[0] - 3, axis=0)
    one_problem_naming(check_corpus(corpus), shard(corpus), "dataset 'labels'", "entries",
                       "rows of 'feats'")


def test_wrong_dtype_and_missing_dataset(corpus):
    with h5py.File(shard(corpus), "a") as f:
        offsets = f["utt_offsets"][()]
        del f["utt_offsets"]
        f["utt_offsets"] = offsets.astype(np.int32)
        del f["utt_ids"]
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "dataset 'utt_offsets'", "int32", "int64")
    one_problem_naming(problems, shard(corpus), "dataset 'utt_ids' is missing")


def test_offsets_not_monotone(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["utt_offsets"][2] = f["utt_offsets"][1]
    one_problem_naming(check_corpus(corpus), shard(corpus), "dataset 'utt_offsets'",
                       "not strictly increasing at utterance 1")


def test_overwritten_labels_disagree_with_class_counts(corpus):
    with h5py.File(shard(corpus), "a") as f:
        labels = f["labels"][()]
        f["labels"][labels == 2] = 3
    one_problem_naming(check_corpus(corpus), manifest_path(corpus), "field 'class_counts'",
                       "class 2")


def test_not_an_hdf5_file(corpus):
    with open(shard(corpus), "wb") as f:
        f.write(b"not hdf5 at all")
    one_problem_naming(check_corpus(corpus), shard(corpus), "cannot open as HDF5")


@pytest.mark.parametrize("field,value,expected", [
    ("num_classes", -3, "field 'num_classes': expected a positive int"),
    ("cmvn", {"mean": [0.0] * 4}, "field 'cmvn.var': expected a list of 4 finite numbers"),
    ("shards", [{"path": "/abs/shard.h5", "frames": 1, "utterances": 1}],
     "field 'shards[0].path': expected a relative file name"),
])
def test_garbled_manifest_field(corpus, field, value, expected):
    path = manifest_path(corpus)
    with open(path) as f:
        data = yaml.safe_load(f)
    data[field] = value
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    one_problem_naming(check_corpus(corpus), path, expected)


def test_manifest_frames_disagree_with_shard(corpus):
    path = manifest_path(corpus)
    with open(path) as f:
        data = yaml.safe_load(f)
    data["shards"][0]["frames"] += 1
    data["shards"][1]["frames"] -= 1
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "shards[0].frames")
    one_problem_naming(problems, shard(corpus, 1), "shards[1].frames")


def test_missing_manifest(tmp_path):
    one_problem_naming(check_corpus(str(tmp_path)), "corpus.yaml", "not found")


def test_cmvn_statistics_disagree_with_features(corpus):
    path = manifest_path(corpus)
    with open(path) as f:
        data = yaml.safe_load(f)
    data["cmvn"]["mean"][1] += 0.5
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    problems = check_corpus(corpus)
    assert problems == [f"{path}: field 'cmvn.mean' does not match the mean of the shards' "
                        "features"]


def test_dataset_declared_beyond_its_stored_data_is_reported_not_scanned(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"].resize(10 ** 9, axis=0)
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "dataset 'labels' declares shape (1000000000,)")
