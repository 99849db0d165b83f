"""check_corpus: a sound corpus passes, each kind of damage is named precisely."""

import os

import h5py
import numpy as np
import pytest

from mpitrain.data import validate as validate_module
from mpitrain.data.check import check_corpus
from mpitrain.data.corpus import manifest_path
from mpitrain.data.shards import write_shard

from .corpora import (FEAT_DIM, NUM_CLASSES, edit_manifest, layout_damage_cases,
                      one_problem_naming, overwrite, shard, signature_offsets, utterance_at,
                      write_corpus)


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def test_a_sound_corpus_has_no_problems(corpus, monkeypatch):
    assert check_corpus(corpus) == []
    # Scanning in many small blocks gives the same verdict (and the same statistics).
    monkeypatch.setattr(validate_module, "BLOCK_FRAMES", 7)
    assert check_corpus(corpus) == []


def test_label_out_of_range(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"][3] = 6
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "dataset 'labels'", "outside [0, 6)",
                       "is 6 at frame 3")


def test_nan_in_features(corpus, monkeypatch):
    monkeypatch.setattr(validate_module, "BLOCK_FRAMES", 5)
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
    # (the moments of features holding a NaN, written by hand: said what it comes from)
    ("cmvn", {"mean": [float("nan")] * 4, "var": [1.0] * 4},
     "field 'cmvn.mean': holds a NaN or inf, as features that hold one give; `mpitrain check`"),
    ("shards", [{"path": "/abs/shard.h5", "frames": 1, "utterances": 1}],
     "field 'shards[0].path': expected a relative file name"),
])
def test_garbled_manifest_field(corpus, field, value, expected):
    path = edit_manifest(corpus, lambda data: data.update({field: value}))
    one_problem_naming(check_corpus(corpus), path, expected)


def test_declared_sizes_past_their_limits_are_reported_without_allocating(corpus):
    # num_classes: 1e9 allocated 8 GB of class counts (a minute, on a shared node)
    # and 1e23 ended in NumPy's "Maximum allowed dimension exceeded" naming no file
    for num_classes in (10 ** 23, 10 ** 9):
        path = edit_manifest(corpus, lambda data: data.update(num_classes=num_classes))
        one_problem_naming(check_corpus(corpus), path,
                           "field 'num_classes': expected at most 1048576")


def test_a_boolean_in_the_manifest_is_named_as_yaml_reads_it(corpus):
    # it said "got True"; format_version: on was taken for 1
    path = edit_manifest(corpus, lambda data: data.update(feat_dim=True))
    one_problem_naming(check_corpus(corpus), path,
                       "field 'feat_dim': expected a positive int, got true (a boolean)")
    path = edit_manifest(corpus, lambda data: data.update(feat_dim=FEAT_DIM,
                                                          format_version=True))
    one_problem_naming(check_corpus(corpus), path,
                       "field 'format_version': expected 1, got true (a boolean)")


def test_manifest_frames_disagree_with_shard(corpus):
    def change(data):
        data["shards"][0]["frames"] += 1
        data["shards"][1]["frames"] -= 1
    edit_manifest(corpus, change)
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "shards[0].frames")
    one_problem_naming(problems, shard(corpus, 1), "shards[1].frames")


def test_missing_manifest(tmp_path):
    one_problem_naming(check_corpus(str(tmp_path)), "corpus.yaml", "not found")


def test_cmvn_statistics_disagree_with_features(corpus):
    def change(data):
        data["cmvn"]["mean"][1] += 0.5
    path = edit_manifest(corpus, change)
    problems = check_corpus(corpus)
    assert problems == [f"{path}: field 'cmvn.mean' does not match the mean of the shards' "
                        "features"]


def test_dataset_declared_beyond_its_stored_data_is_reported_not_scanned(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"].resize(10 ** 9, axis=0)
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "dataset 'labels' declares shape (1000000000,)")


# ---------------------------------------------------------------- empty corpora

def _empty_manifest(data):
    data.update(num_frames=0, num_utterances=0, class_counts=[0] * NUM_CLASSES)
    for entry in data["shards"]:
        entry.update(frames=0, utterances=0)


def test_corpus_of_empty_shards(corpus):
    for i in range(2):
        os.remove(shard(corpus, i))
        write_shard(shard(corpus, i), [], [], [], feat_dim=FEAT_DIM)
    path = edit_manifest(corpus, _empty_manifest)
    assert check_corpus(corpus) == [f"{path}: field 'num_frames' is 0 (2 shard(s), "
                                    "0 utterance(s)); expected a corpus with at least one frame"]


def test_manifest_of_zero_frames_over_full_shards(corpus):
    path = edit_manifest(corpus, _empty_manifest)
    problems = check_corpus(corpus)
    one_problem_naming(problems, path, "field 'num_frames' is 0")
    one_problem_naming(problems, shard(corpus), "dataset 'feats' has", "shards[0].frames) says 0")
    one_problem_naming(problems, shard(corpus, 1), "dataset 'utt_offsets' lists",
                       "shards[1].utterances) says 0")


def test_manifest_with_no_shards(corpus):
    def change(data):
        _empty_manifest(data)
        data["shards"] = []
    path = edit_manifest(corpus, change)
    one_problem_naming(check_corpus(corpus), path, "field 'shards'", "expected a non-empty list")


def test_manifest_of_frames_in_no_utterances(corpus):
    def change(data):
        for entry in data["shards"]:
            entry["utterances"] = 0
        data["num_utterances"] = 0
    path = edit_manifest(corpus, change)
    one_problem_naming(check_corpus(corpus), path, "field 'num_utterances' is 0",
                       "expected at least one utterance")


# ---------------------------------------------------------------- every kind of bad data

def test_nan_names_the_utterance(corpus):
    with h5py.File(shard(corpus, 1), "a") as f:
        f["feats"][50, 0] = np.nan
        f["feats"][51, 0] = np.inf
    utt, k = utterance_at(shard(corpus, 1), 50)
    one_problem_naming(check_corpus(corpus), shard(corpus, 1), "dataset 'feats'",
                       "2 frame(s) contain NaN or inf",
                       f"frame 50 (utterance {utt!r}, frame {k} of it)")


def test_negative_label_names_the_utterance(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"][70] = -4
    utt, k = utterance_at(shard(corpus), 70)
    one_problem_naming(check_corpus(corpus), shard(corpus), "dataset 'labels'",
                       "1 label(s) outside [0, 6)",
                       f"the first is -4 at frame 70 (utterance {utt!r}, frame {k} of it)")


@pytest.mark.parametrize("damage,parts", layout_damage_cases())
def test_layout_damage_is_one_line_naming_shard_and_dataset(corpus, damage, parts):
    damage(shard(corpus, 1))
    one_problem_naming(check_corpus(corpus), shard(corpus, 1), *parts)


def test_manifest_utterances_disagree_with_shard(corpus):
    def change(data):
        data["shards"][0]["utterances"] += 1
        data["shards"][1]["utterances"] -= 1
    path = edit_manifest(corpus, change)
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "dataset 'utt_offsets' lists", path,
                       "shards[0].utterances")


def test_duplicate_utterance_id(corpus):
    with h5py.File(shard(corpus), "r") as f:
        ids = list(f["utt_ids"].asstr()[()])
    with h5py.File(shard(corpus, 1), "a") as f:
        f["utt_ids"][0] = ids[2]
    one_problem_naming(check_corpus(corpus), shard(corpus, 1), "dataset 'utt_ids'",
                       f"utterance {ids[2]!r} appears also in {shard(corpus)}")


def test_duplicate_utterance_id_within_one_shard(corpus):
    with h5py.File(shard(corpus), "a") as f:
        ids = list(f["utt_ids"].asstr()[()])
        f["utt_ids"][1] = ids[0]
    one_problem_naming(check_corpus(corpus), shard(corpus), "dataset 'utt_ids'",
                       f"utterance {ids[0]!r} appears twice in this shard")


def test_a_shard_path_outside_the_corpus_is_reported_and_never_opened(corpus, tmp_path):
    outside = tmp_path / "elsewhere.h5"
    outside.write_bytes(b"not a shard")

    def change(data):
        data["shards"][0]["path"] = str(outside)
    edit_manifest(corpus, change)
    problems = check_corpus(corpus)
    assert any("a relative file name inside the corpus directory" in p for p in problems)
    assert not any("elsewhere.h5: " in p for p in problems), problems


# ---------------------------------------------------------------- damaged on disk

def test_damaged_index_of_datasets(corpus):
    # The root group's symbol table node lists the datasets by name.
    overwrite(shard(corpus), dict(signature_offsets(shard(corpus)))[b"SNOD"], b"XXXX")
    problems = check_corpus(corpus)
    one_problem_naming(problems, shard(corpus), "the index of its datasets cannot be read",
                       "the file is damaged")


def test_every_damaged_structure_is_one_line(tmp_path):
    sound = write_corpus(tmp_path / "sound")
    structures = signature_offsets(shard(sound))
    assert {s for s, _ in structures} == {b"TREE", b"HEAP", b"SNOD", b"GCOL"}
    for n, (signature, offset) in enumerate(structures):
        corpus = write_corpus(tmp_path / f"c{n}")
        overwrite(shard(corpus), offset, b"XXXX")
        problems = check_corpus(corpus)
        assert problems, (signature, offset)
        one_problem_naming(problems, shard(corpus), "the file is damaged")


@pytest.mark.parametrize("dataset,pattern,at", [
    # a float32's datatype message (its exponent bias): no numpy float represents it
    ("feats", bytes([0x11, 0x20, 0x1F, 0x00, 0x04, 0, 0, 0, 0, 0, 0x20, 0x00]), 17),
    # a variable-length string's character set
    ("utt_ids", b"\x19\x01\x01", 2)])
def test_a_damaged_datatype_is_one_line_naming_the_dataset(tmp_path, dataset, pattern, at):
    """One byte of a dataset's datatype message: check, train and eval stopped with
    h5py's 'Insufficient precision in available types' naming nothing, or a TypeError
    traceback ('Unknown string encoding')."""
    from mpitrain.data.corpus import load_manifest
    from mpitrain.data.validate import validate_corpus
    corpus = write_corpus(tmp_path / "c")
    path = shard(corpus)
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    data[data.index(pattern) + at] ^= 0xFF
    with open(path, "wb") as fh:
        fh.write(data)
    said = f"dataset '{dataset}' has a datatype that cannot be read"
    one_problem_naming(check_corpus(corpus), path, said, "the file is damaged")
    one_problem_naming(validate_corpus(load_manifest(corpus)), path, said)


def test_a_chunk_index_pointing_past_the_file_is_one_line_naming_the_dataset(tmp_path,
                                                                              monkeypatch):
    """A flipped bit in the address of a 'feats' chunk: the search for the file's text
    heaps walked up to that address a megabyte at a time (half a minute for 2**48,
    ending on 'cannot open as HDF5 ([Errno 22] Invalid argument)'; for ever past
    2**63)."""
    import struct

    from mpitrain import h5io
    searched = []
    search = h5io._collections_between
    monkeypatch.setattr(h5io, "_collections_between",
                        lambda fh, start, stop, size: searched.append(stop <= size)
                        or search(fh, start, stop, size))
    corpus = write_corpus(tmp_path / "c")
    path = shard(corpus)
    with h5py.File(path, "r") as f:
        chunks = []
        f["feats"].id.chunk_iter(chunks.append)
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    tree = data.index(b"TREE")
    at = data.index(struct.pack("<Q", chunks[0].byte_offset), tree)
    data[at + 5] ^= 0x01                  # the address, 2**40 further on
    with open(path, "wb") as fh:
        fh.write(data)
    searched.clear()
    one_problem_naming(check_corpus(corpus), path, "dataset 'feats': cannot read frames",
                       "the file is damaged")
    assert searched and all(searched)      # never past the file's end


def test_overwritten_file_start(corpus):
    overwrite(shard(corpus, 1), 0, b"\0" * 64)
    one_problem_naming(check_corpus(corpus), shard(corpus, 1), "cannot open as HDF5")


def test_utterance_ids_that_are_not_utf8_are_named(corpus):
    # a shard written by another program with Latin-1 ids: check, train and eval
    # stopped with "'utf-8' codec can't decode byte 0xdc" naming no file
    from mpitrain.data.corpus import CorpusError, load_manifest
    from mpitrain.data.shards import ShardReader
    from mpitrain.data.validate import validate_corpus

    from .corpora import replace_dataset
    path = shard(corpus)
    with h5py.File(path, "r") as f:
        ids = [utt.encode() for utt in f["utt_ids"].asstr()[()]]
        bad_frame = int(f["utt_offsets"][1]) + 2       # frame 2 of utterance 1
    ids[1] = b"spk\xdc-utt1"
    replace_dataset(path, "utt_ids", np.array(ids, dtype=h5py.string_dtype("utf-8")))
    with h5py.File(path, "a") as f:
        f["feats"][bad_frame, 0] = np.nan
    problems = check_corpus(corpus)
    one_problem_naming(problems, path, "dataset 'utt_ids': the id of utterance 1 is not UTF-8",
                       "b'spk\\xdc-utt1'")
    # the bad frame names its utterance with the bytes escaped
    one_problem_naming(problems, path, "dataset 'feats'", "'spk\\\\xdc-utt1', frame 2 of it")
    one_problem_naming(validate_corpus(load_manifest(corpus)), path, "dataset 'feats'")
    with ShardReader(path) as reader, pytest.raises(CorpusError, match="is not UTF-8"):
        reader.utt_ids


@pytest.mark.parametrize("bad_id", ["", "utt 7"])
def test_an_empty_or_spaced_utterance_id_is_named(corpus, bad_id):
    """The corpus writer refuses such ids (export writes them as Kaldi archive keys);
    one edited into a shard passed `check`."""
    with h5py.File(shard(corpus), "a") as f:
        f["utt_ids"][1] = bad_id
    one_problem_naming(check_corpus(corpus), shard(corpus), "dataset 'utt_ids'",
                       f"utterance id {bad_id!r} is empty or holds whitespace")
