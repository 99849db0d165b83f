"""Shard files: written and read back exactly, damaged files named precisely."""

import os

import h5py
import numpy as np
import pytest

from mpitrain.data.corpus import CorpusError
from mpitrain.data.shards import ShardReader, chunk_rows, write_shard

from .utterances import make_utterances


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


def test_a_directory_or_a_bad_utterance_index_is_one_line_naming_it(tmp_path):
    # a directory gave HDF5's message, which holds a line break; read(0, 2.7) read
    # utterances 0:2, and read("a", 2) failed in int() naming neither argument
    (tmp_path / "d").mkdir()
    with pytest.raises(CorpusError, match=r"^.*/d: is a directory, not a shard file$"):
        ShardReader(str(tmp_path / "d"))
    (tmp_path / "t.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    with pytest.raises(CorpusError, match="t.h5: cannot open as HDF5") as err:
        ShardReader(str(tmp_path / "t.h5"))
    assert "\n" not in str(err.value)
    utts = make_utterances(3)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    with ShardReader(path) as shard:
        for start, end, name in ((0, 2.7, "end_utt"), ("a", 2, "start_utt"),
                                 (None, 2, "start_utt"), (True, 2, "start_utt")):
            with pytest.raises(TypeError, match=rf"s.h5: read: {name}: expected an utterance "
                                                r"index \(an integer\), got "):
                shard.read(start, end)
        assert shard.read(np.int64(1), 2.0)[2].tolist() == [0, len(utts[1][1])]


def test_reader_names_file_and_dataset_when_dataset_is_missing(tmp_path):
    utts = make_utterances(2)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    with h5py.File(path, "a") as f:
        del f["labels"]
    with pytest.raises(CorpusError) as err:
        ShardReader(path)
    assert path in str(err.value) and "'labels' is missing" in str(err.value)


def test_several_problems_of_a_shard_are_one_line_naming_it_once(tmp_path):
    # (joined by newlines, flattened to one line: `S: ... missing S: ... missing`)
    utts = make_utterances(2)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    with h5py.File(path, "a") as f:
        del f["feats"], f["utt_ids"]
    with pytest.raises(CorpusError) as err:
        ShardReader(path)
    assert str(err.value) == (f"{path}: dataset 'feats' is missing; "
                              "dataset 'utt_ids' is missing")


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


def test_a_shard_of_big_endian_datasets_reads_as_any_other(tmp_path):
    # another program's float32 '>f4' (int32 '>i4', int64 '>i8') was refused as
    # "dtype >f4; expected float32"
    from mpitrain.data.check import check_corpus
    from .corpora import shard, write_corpus
    corpus = write_corpus(tmp_path / "c", num_shards=1)
    with ShardReader(shard(corpus)) as reader:
        before = reader.read(0, reader.num_utterances)
    with h5py.File(shard(corpus), "a") as f:
        for name in ("feats", "labels", "utt_offsets"):
            data = f[name][()]
            del f[name]
            f[name] = data.astype(data.dtype.newbyteorder(">"))
    assert check_corpus(corpus) == []
    with ShardReader(shard(corpus)) as reader:
        after = reader.read(0, reader.num_utterances)
    for old, new in zip(before, after):
        assert new.dtype == old.dtype
        np.testing.assert_array_equal(new, old)


@pytest.mark.parametrize("version,shown", [
    ("abc", "'abc'"), (float("nan"), "nan"), (1.5, "1.5"), (True, "True"), ([1, 1], "[1, 1]"),
], ids=["text", "nan", "float", "bool", "array"])
def test_a_format_version_that_is_not_the_integer_1_is_named(tmp_path, version, shown):
    # a text or NaN stopped the reader (and check, and every rank of train) with
    # "invalid literal for int()" naming no file; 1.5 and True were taken for 1
    from mpitrain.data.validate import ShardCheck
    utts = make_utterances(2)
    path = str(tmp_path / "s.h5")
    write_shard(path, [u[0] for u in utts], [u[1] for u in utts], [u[2] for u in utts])
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = version
    with pytest.raises(CorpusError) as err:
        ShardReader(path)
    message = str(err.value)
    assert message.startswith(f"{path}: attribute 'format_version' is ") and shown in message \
        and message.endswith("; expected the integer 1"), message
    with ShardCheck(path, feat_dim=utts[0][1].shape[1]) as shard:
        assert shard.problems == [message]
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = np.int32(1)
    ShardReader(path).close()


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


@pytest.mark.parametrize("at", ["data", "index"])
def test_a_failed_write_is_one_error_naming_the_shard_and_no_crash(tmp_path, at):
    # HDF5 that met a failed write (a full disk; here a file size limit, as
    # `ulimit -f` sets) was left broken: the error named the hidden temporary, and
    # the process died of a bus error or a segmentation fault at exit (status 135)
    import subprocess
    import sys
    # one long utterance fails writing the frames; many short ones with long ids
    # fail writing the utterance index when the file is finished
    frames, dim, count = (40000, 40, 1) if at == "data" else (1, 1, 2000)
    code = ("import resource, sys\n"
            "import numpy as np\n"
            "from mpitrain.data.shards import write_shard\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (200000, 200000))\n"
            f"ids = [f'utt{{i:09d}}' * 20 for i in range({count})]\n"
            "try:\n"
            f"    feats = [np.ones(({frames}, {dim}), np.float32)] * {count}\n"
            f"    write_shard(sys.argv[1], ids, feats, [np.zeros({frames}, int)] * {count})\n"
            "except OSError as exc:\n"
            "    print(exc)\n")
    target = tmp_path / "shard-00000.h5"
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"cannot write {target}: File too large", out.stdout
    assert os.listdir(tmp_path) == []
