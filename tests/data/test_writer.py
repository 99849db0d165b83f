"""The corpus writer: balanced shards, statistics, whole-or-nothing output, bad input."""

import os

import numpy as np
import pytest

from mpitrain.data.corpus import CorpusError, load_manifest
from mpitrain.data.shards import ShardReader
from mpitrain.data.writer import CorpusWriter

from .utterances import make_utterances


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


def test_writer_failure_leaves_no_manifest_and_no_partial_files(tmp_path):
    out = str(tmp_path / "c")
    with pytest.raises(RuntimeError):
        with CorpusWriter(out, feat_dim=2, num_classes=3, num_shards=2) as writer:
            writer.add("a", np.zeros((4, 2), np.float32), np.zeros(4, int))
            raise RuntimeError("interrupted")
    assert not os.path.exists(out)      # nor the directory the writer made


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


def test_features_beyond_float32_or_of_no_number_dtype_are_named_as_such(tmp_path):
    # 1e300 in float64 was stored as inf and called "NaN or inf" (with NumPy's overflow
    # warning); a complex array lost its imaginary part without a word; a ragged list
    # failed in NumPy naming nothing
    import warnings
    with CorpusWriter(str(tmp_path / "c"), feat_dim=2, num_classes=3,
                      num_shards=1) as writer:
        huge = np.zeros((4, 2))
        huge[2, 1] = 1e300
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=r"'u1': 1 value\(s\) beyond the float32 "
                                                 r"range features are stored in, the first "
                                                 r"1e\+300 at frame 2, dimension 1$"):
                writer.add("u1", huge, np.zeros(4, int))
        for bad in (np.zeros((4, 2), np.complex64), np.zeros((4, 2), bool)):
            with pytest.raises(ValueError, match=rf"'u2': feats must be float or integer "
                                                 rf"numbers, got dtype {bad.dtype}"):
                writer.add("u2", bad, np.zeros(4, int))
        with pytest.raises(ValueError, match=r"'u3': feats and labels must each be one "
                                             r"rectangular array of numbers"):
            writer.add("u3", [[0.0, 1.0], [0.0]], [0, 0])
        writer.add("u4", np.full((4, 2), 1e30), np.zeros(4, int))
        writer.add("u5", np.ones((4, 2), np.int64), np.zeros(4, int))
    assert load_manifest(str(tmp_path / "c")).num_frames == 8


def test_more_shards_than_utterances_gives_valid_empty_shards(tmp_path):
    out = str(tmp_path / "c")
    with CorpusWriter(out, feat_dim=2, num_classes=2, num_shards=3) as writer:
        writer.add("a", np.zeros((4, 2), np.float32), np.zeros(4, int))
    manifest = load_manifest(out)
    assert [s.frames for s in manifest.shards] == [4, 0, 0]
    with ShardReader(manifest.shard_path(2)) as shard:
        assert shard.num_utterances == 0 and shard.utt_ids == []


def _write(out, utts, shards, overwrite=False):
    with CorpusWriter(out, feat_dim=6, num_classes=5, num_shards=shards,
                      overwrite=overwrite) as writer:
        for utt in utts:
            writer.add(*utt)


def test_a_failed_overwrite_leaves_the_old_corpus_whole(tmp_path):
    out = str(tmp_path / "corpus")
    _write(out, make_utterances(12, num_classes=5), 2)
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    with pytest.raises(ValueError, match="NaN"):
        with CorpusWriter(out, feat_dim=6, num_classes=5, num_shards=2,
                          overwrite=True) as writer:
            for utt_id, feats, labels in make_utterances(5, num_classes=5):
                writer.add(utt_id, feats, labels)
            writer.add("bad", np.full((4, 6), np.nan, np.float32), np.zeros(4, np.int64))
    after = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    assert after == before
    assert load_manifest(out).num_utterances == 12


def test_an_overwrite_with_fewer_shards_removes_the_old_extra_shards(tmp_path):
    out = str(tmp_path / "corpus")
    _write(out, make_utterances(12, num_classes=5), 4)
    _write(out, make_utterances(6, num_classes=5), 2, overwrite=True)
    assert sorted(os.listdir(out)) == ["corpus.yaml", "shard-00000.h5", "shard-00001.h5"]
    manifest = load_manifest(out)
    assert manifest.num_utterances == 6 and len(manifest.shards) == 2


def test_a_full_disk_names_the_shard_and_leaves_no_temporaries(tmp_path, monkeypatch):
    from mpitrain import files
    from mpitrain.data import shards
    real_flush = shards.ShardBuilder._flush

    def full(self):
        if self._pending_frames:
            raise RuntimeError("Can't decrement id ref count (slist already enabled?)")
        return real_flush(self)

    monkeypatch.setattr(shards.ShardBuilder, "_flush", full)
    monkeypatch.setattr(files, "_nearly_full", lambda path: True)   # as on a full device
    out = str(tmp_path / "c" / "train")
    with pytest.raises(files.DiskFullError, match="no space left on device writing .*shard-0000"):
        with CorpusWriter(out, feat_dim=6, num_classes=5, num_shards=2) as writer:
            for utt in make_utterances(12, num_classes=5):
                writer.add(*utt)
    # nor the directories it made (they were left empty, looking like a corpus begun)
    assert os.listdir(tmp_path) == []
    # a directory that was there stays, and so does what else it holds
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(files.DiskFullError):
        with CorpusWriter(str(tmp_path / "kept"), feat_dim=6, num_classes=5,
                          num_shards=2) as writer:
            for utt in make_utterances(12, num_classes=5):
                writer.add(*utt)
    assert os.listdir(tmp_path / "kept") == ["notes.txt"]


def test_partial_shards_of_a_killed_writer_do_not_pile_up(tmp_path):
    """A prepare or synth killed mid-write and run again: its partial shards (as large
    as the shards) go; files of other writers in the directory stay."""
    from mpitrain.files import temporary_path
    out = tmp_path / "corpus"
    out.mkdir()
    for pid in (11, 12):                 # two killed attempts
        for name in ("shard-00000.h5", "shard-00001.h5", "corpus.yaml", "notes.txt"):
            stale = temporary_path(out / name).replace(f"-{os.getpid()}", f"-{pid}")
            with open(stale, "wb") as fh:
                fh.write(b"x" * 100)
    utts = make_utterances(6, num_classes=3)
    with CorpusWriter(str(out), feat_dim=6, num_classes=3, num_shards=2) as writer:
        for utt in utts:
            writer.add(*utt)
    assert sorted(os.listdir(out)) == [".notes.txt.tmp-11", ".notes.txt.tmp-12", "corpus.yaml",
                                       "shard-00000.h5", "shard-00001.h5"]
    assert len(writer.removed_temporaries) == 6


def test_a_second_writer_of_the_directory_at_the_same_time_is_named(tmp_path):
    """Its partial shards taken for a killed writer's: the first writer stops with one
    line, and the corpus the second one wrote keeps its manifest."""
    out = str(tmp_path / "corpus")
    utts = make_utterances(6, num_classes=3)
    first = CorpusWriter(out, feat_dim=6, num_classes=3, num_shards=2)
    for utt in utts:
        first.add(*utt)
    os.remove(first._builders[1].temporary)      # as a writer started later does
    with pytest.raises(CorpusError, match=r"corpus: another process wrote this corpus at "
                                          r"the same time \(the partial shard-00001.h5"):
        first.close()
    assert not os.path.exists(out)      # (the second writer's corpus would keep it)


def test_a_corpus_directory_that_cannot_be_made_is_one_line_naming_it(tmp_path):
    # it was the bare "[Errno 20] Not a directory: '...'" (or "[Errno 30] Read-only
    # file system: ..." under a read-only mount)
    (tmp_path / "a-file").write_text("x")
    out = str(tmp_path / "a-file" / "c" / "train")
    with pytest.raises(CorpusError) as err:
        CorpusWriter(out, feat_dim=6, num_classes=5, num_shards=1)
    assert str(err.value) == (f"{out}: cannot create the corpus directory (Not a directory: "
                              f"{tmp_path / 'a-file' / 'c'})")


@pytest.mark.parametrize("utt_id", ["a b", "a\tb", "ab\n"])
def test_an_utterance_id_holding_whitespace_is_refused(tmp_path, utt_id):
    # (accepted: export then wrote keys that Kaldi reads as another id and a bad record)
    with CorpusWriter(str(tmp_path / "c"), feat_dim=4, num_classes=3, num_shards=1) as writer:
        with pytest.raises(ValueError, match="holds whitespace, which a Kaldi id cannot"):
            writer.add(utt_id, np.zeros((5, 4), np.float32), np.zeros(5, np.int64))
        writer.add("a-b", np.zeros((5, 4), np.float32), np.zeros(5, np.int64))
