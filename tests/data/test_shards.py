"""Shard files, the corpus manifest and the corpus writer."""

import os

import h5py
import numpy as np
import pytest
import yaml

from mpitrain.data.corpus import CorpusError, load_manifest, manifest_path
from mpitrain.data.writer import CorpusWriter
from mpitrain.data.shards import ShardReader, chunk_rows, write_shard


def make_utterances(n, dim=6, num_classes=5, seed=0):
    rng = np.random.default_rng(seed)
    utts = []
    for i in range(n):
        t = int(rng.integers(3, 40))
        utts.append((f"utt{i:03d}", rng.normal(i, 1.0, (t, dim)).astype(np.float32),
                     rng.integers(0, num_classes, t)))
    return utts


def test_write_and_read_back_exactly(tmp_path):
    utts = make_utterances(7)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    lengths = [u[1].shape[0] for u in utts]
    with ShardReader(path) as shard:
        assert shard.num_utterances == 7
        assert shard.num_frames == sum(lengths)
        assert shard.feat_dim == 6
        assert shard.utt_ids == [u[0] for u in utts]
        assert shard.utt_offsets.dtype == np.int64
        assert shard.utt_offsets.tolist() == np.r_[0, np.cumsum(lengths)].tolist()
        feats, labels, offsets = shard.read(2, 5)
        assert feats.dtype == np.float32 and labels.dtype == np.int32
        assert offsets.tolist() == np.r_[0, np.cumsum(lengths[2:5])].tolist()
        np.testing.assert_array_equal(feats, np.concatenate([u[1] for u in utts[2:5]]))
        np.testing.assert_array_equal(labels, np.concatenate([u[2] for u in utts[2:5]]))
        empty_feats, empty_labels, empty_offsets = shard.read(3, 3)
        assert empty_feats.shape == (0, 6) and empty_labels.shape == (0,)
        assert empty_offsets.tolist() == [0]
        with pytest.raises(ValueError, match="outside 0:7"):
            shard.read(5, 8)
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == 1
        assert f["feats"].chunks == (chunk_rows(6), 6)
        assert f["feats"].compression is None
    assert not any(name.endswith(".partial") for name in os.listdir(tmp_path))


def test_reader_names_file_and_dataset_when_dataset_is_missing(tmp_path):
    utts = make_utterances(2)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    with h5py.File(path, "a") as f:
        del f["labels"]
    with pytest.raises(CorpusError) as err:
        ShardReader(path)
    assert path in str(err.value) and "'labels' is missing" in str(err.value)


def test_reader_names_dataset_of_wrong_dtype(tmp_path):
    utts = make_utterances(2)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    with h5py.File(path, "a") as f:
        feats = f["feats"][()]
        del f["feats"]
        f["feats"] = feats.astype(np.float64)
    with pytest.raises(CorpusError, match=r"dataset 'feats' has dtype float64; expected float32"):
        ShardReader(path)
    with pytest.raises(CorpusError, match="not found"):
        ShardReader(str(tmp_path / "absent.h5"))


def test_corpus_writer_balances_shards_and_records_statistics(tmp_path):
    utts = make_utterances(40, num_classes=5)
    out = str(tmp_path / "corpus")
    with CorpusWriter(out, feat_dim=6, num_classes=5, num_shards=3,
                      source={"kind": "test", "seed": 0}) as writer:
        for utt in utts:
            writer.add(*utt)
    manifest = load_manifest(out)
    all_feats = np.concatenate([u[1] for u in utts]).astype(np.float64)
    all_labels = np.concatenate([u[2] for u in utts])
    assert manifest.num_frames == all_feats.shape[0]
    assert manifest.num_utterances == 40
    assert manifest.class_counts == np.bincount(all_labels, minlength=5).tolist()
    np.testing.assert_allclose(manifest.cmvn_mean, all_feats.mean(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(manifest.cmvn_var, all_feats.var(0), rtol=1e-9)
    assert manifest.source == {"kind": "test", "seed": 0}
    assert [s.path for s in manifest.shards] == ["shard-00000.h5", "shard-00001.h5",
                                                 "shard-00002.h5"]
    # Greedy to the lightest shard: shards differ by at most one utterance.
    frames = [s.frames for s in manifest.shards]
    assert max(frames) - min(frames) <= max(u[1].shape[0] for u in utts)
    # Every utterance is in exactly one shard, unchanged.
    by_id = {u[0]: u for u in utts}
    seen = []
    for i, info in enumerate(manifest.shards):
        assert os.path.isabs(manifest.shard_path(i))
        with ShardReader(manifest.shard_path(i)) as shard:
            assert (shard.num_frames, shard.num_utterances) == (info.frames, info.utterances)
            feats, labels, offsets = shard.read(0, shard.num_utterances)
            for k, utt_id in enumerate(shard.utt_ids):
                np.testing.assert_array_equal(feats[offsets[k]:offsets[k + 1]], by_id[utt_id][1])
                np.testing.assert_array_equal(labels[offsets[k]:offsets[k + 1]], by_id[utt_id][2])
                seen.append(utt_id)
    assert sorted(seen) == sorted(by_id)
    assert not any(name.startswith(".") for name in os.listdir(out))


def test_class_priors_are_floored_and_normalised(tmp_path):
    out = str(tmp_path / "c")
    with CorpusWriter(out, feat_dim=2, num_classes=4, num_shards=1) as writer:
        writer.add("a", np.zeros((6, 2), np.float32), np.array([0, 0, 0, 1, 1, 3]))
    priors = load_manifest(out).class_priors()
    assert priors.shape == (4,) and priors.min() > 0
    np.testing.assert_allclose(priors.sum(), 1.0)
    np.testing.assert_allclose(priors[[0, 1, 3]], np.array([3, 2, 1]) / 6, rtol=1e-6)


def test_writer_failure_leaves_no_manifest_and_no_partial_files(tmp_path):
    out = str(tmp_path / "c")
    with pytest.raises(RuntimeError):
        with CorpusWriter(out, feat_dim=2, num_classes=3, num_shards=2) as writer:
            writer.add("a", np.zeros((4, 2), np.float32), np.zeros(4, int))
            raise RuntimeError("interrupted")
    assert os.listdir(out) == []


def test_writer_rejects_bad_input_naming_the_utterance(tmp_path):
    with pytest.raises(ValueError, match="num_shards"):
        CorpusWriter(str(tmp_path / "x"), feat_dim=2, num_classes=3, num_shards=0)
    writer = CorpusWriter(str(tmp_path / "c"), feat_dim=2, num_classes=3, num_shards=1)
    with pytest.raises(ValueError, match=r"'u1'.*label 3 is outside \[0, 3\)"):
        writer.add("u1", np.zeros((2, 2), np.float32), np.array([0, 3]))
    with pytest.raises(ValueError, match=r"'u2'.*dimension 3, expected 2"):
        writer.add("u2", np.zeros((2, 3), np.float32), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"'u3'.*labels must have shape \(2,\)"):
        writer.add("u3", np.zeros((2, 2), np.float32), np.array([0]))
    writer.add("u4", np.zeros((2, 2), np.float32), np.array([0, 1]))
    with pytest.raises(ValueError, match="added twice"):
        writer.add("u4", np.zeros((2, 2), np.float32), np.array([0, 1]))
    writer.close()
    with pytest.raises(CorpusError, match="already exists"):
        CorpusWriter(str(tmp_path / "c"), feat_dim=2, num_classes=3, num_shards=1)
    with CorpusWriter(str(tmp_path / "c"), feat_dim=2, num_classes=3, num_shards=1,
                      overwrite=True) as writer:
        writer.add("v", np.ones((5, 2), np.float32), np.zeros(5, int))
    assert load_manifest(str(tmp_path / "c")).num_frames == 5


def test_more_shards_than_utterances_gives_valid_empty_shards(tmp_path):
    out = str(tmp_path / "c")
    with CorpusWriter(out, feat_dim=2, num_classes=2, num_shards=3) as writer:
        writer.add("a", np.zeros((4, 2), np.float32), np.zeros(4, int))
    manifest = load_manifest(out)
    assert [s.frames for s in manifest.shards] == [4, 0, 0]
    with ShardReader(manifest.shard_path(2)) as shard:
        assert shard.num_utterances == 0 and shard.utt_ids == []


@pytest.mark.parametrize("field,value,expected", [
    ("feat_dim", "forty", "field 'feat_dim': expected a positive int"),
    ("class_counts", [1, 2], "field 'class_counts': expected a list of 3 non-negative ints"),
    ("num_frames", 99, "field 'class_counts': sums to"),
    ("format_version", 2, "field 'format_version': expected 1"),
])
def test_load_manifest_names_file_and_field(tmp_path, field, value, expected):
    out = str(tmp_path / "c")
    with CorpusWriter(out, feat_dim=2, num_classes=3, num_shards=1) as writer:
        writer.add("a", np.zeros((4, 2), np.float32), np.array([0, 1, 2, 2]))
    path = manifest_path(out)
    with open(path) as f:
        data = yaml.safe_load(f)
    data[field] = value
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    with pytest.raises(CorpusError) as err:
        load_manifest(out)
    assert path in str(err.value) and expected in str(err.value)


def test_load_manifest_of_a_directory_without_corpus(tmp_path):
    with pytest.raises(CorpusError, match="corpus.yaml: not found"):
        load_manifest(str(tmp_path))
    (tmp_path / "corpus.yaml").write_text("feat_dim: [unclosed\n")
    with pytest.raises(CorpusError, match="corpus.yaml: not valid YAML at line 2"):
        load_manifest(str(tmp_path))


def test_reader_refuses_datasets_declared_beyond_their_stored_data(tmp_path):
    # Grown without writing: HDF5 would hand back fill values, and a reader would
    # allocate the declared size.  The file stores none of it, so it is refused.
    utts = make_utterances(2)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    with h5py.File(path, "a") as f:
        f["feats"].resize(10 ** 8, axis=0)
    with pytest.raises(CorpusError, match=r"s.h5: dataset 'feats' declares shape \(100000000, 6\)"):
        ShardReader(path)
