"""validate_slices / validate_corpus: a rank's part of a corpus, checked before training.

Each bad input gives one line naming the shard file and the dataset and
record (utterance id and frame, or the manifest field) and what was expected;
a rank reports only what lies in its own part.
"""

import os

import h5py
import numpy as np
import pytest

from mpitrain.data import validate as validate_module
from mpitrain.data.corpus import load_manifest
from mpitrain.data.sharding import ShardSlice, plan_shards
from mpitrain.data.shards import ShardReader
from mpitrain.data.validate import (ShardCheck, corpus_frame_ranges, validate_corpus,
                                    validate_slices)

from .corpora import (FEAT_DIM, NUM_CLASSES, edit_manifest, first_chunk_offset,
                      layout_damage_cases, one_problem_naming, overwrite, shard,
                      signature_offsets, utterance_at, write_corpus)


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def whole(manifest, i):
    """Shard ``i`` as the slices of one rank."""
    info = manifest.shards[i]
    return [ShardSlice(i, 0, info.utterances, info.frames)]


def validate_shard(corpus, i=0, **kw):
    manifest = load_manifest(corpus)
    return validate_slices(manifest, whole(manifest, i), **kw)


def split_plan(manifest, size):
    def offsets(i):
        with ShardReader(manifest.shard_path(i)) as reader:
            return reader.utt_offsets
    return plan_shards(manifest.shards, size, utt_offsets_of=offsets, split=True)


# ---------------------------------------------------------------- sound data

def test_every_rank_of_a_sound_corpus_finds_nothing(corpus, monkeypatch):
    manifest = load_manifest(corpus)
    for size in (1, 2, 3):
        for slices in split_plan(manifest, size):
            assert validate_slices(manifest, slices) == []
        for rank in range(size):
            assert validate_corpus(manifest, rank=rank, size=size) == []
    # Many small blocks, the same verdict.
    monkeypatch.setattr(validate_module, "BLOCK_FRAMES", 7)
    assert validate_slices(manifest, whole(manifest, 0) + whole(manifest, 1)) == []


def test_blocks_stay_within_their_byte_bound(corpus, monkeypatch):
    reads = []
    read_direct = h5py.Dataset.read_direct

    def counted(self, dest, source_sel=None, dest_sel=None):
        reads.append(dest.nbytes)
        return read_direct(self, dest, source_sel, dest_sel)
    monkeypatch.setattr(h5py.Dataset, "read_direct", counted)
    monkeypatch.setattr(validate_module, "BLOCK_BYTES", 3 * FEAT_DIM * 4)
    with h5py.File(shard(corpus), "a") as f:
        f["labels"][100] = 50
    one_problem_naming(validate_shard(corpus), shard(corpus), "the first is 50 at frame 100")
    assert max(reads) == 3 * FEAT_DIM * 4


def test_no_slices_is_nothing_to_check(corpus):
    assert validate_slices(load_manifest(corpus), []) == []


# ---------------------------------------------------------------- frames

def test_nan_features_name_shard_utterance_frame_and_count(corpus, monkeypatch):
    monkeypatch.setattr(validate_module, "BLOCK_FRAMES", 16)
    with h5py.File(shard(corpus), "a") as f:
        f["feats"][40, 1] = np.nan
        f["feats"][41, 0] = np.nan
        f["feats"][100, 3] = np.nan
    utt, k = utterance_at(shard(corpus), 40)
    one_problem_naming(validate_shard(corpus), shard(corpus), "dataset 'feats'",
                       "3 frame(s) contain NaN or inf", f"the first at frame 40 (utterance "
                       f"{utt!r}, frame {k} of it)", "expected finite features")


def test_inf_features(corpus):
    with h5py.File(shard(corpus, 1), "a") as f:
        f["feats"][0, 0] = -np.inf
    one_problem_naming(validate_shard(corpus, 1), shard(corpus, 1), "dataset 'feats'",
                       "1 frame(s) contain NaN or inf", "frame 0 (utterance 'utt001', frame 0")


def test_label_above_the_classes_names_shard_utterance_frame_value_and_count(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"][60] = NUM_CLASSES
        f["labels"][61] = 99
    utt, k = utterance_at(shard(corpus), 60)
    one_problem_naming(validate_shard(corpus), shard(corpus), "dataset 'labels'",
                       f"2 label(s) outside [0, {NUM_CLASSES})",
                       f"the first is {NUM_CLASSES} at frame 60 (utterance {utt!r}, "
                       f"frame {k} of it)")


def test_negative_label(corpus):
    with h5py.File(shard(corpus), "a") as f:
        f["labels"][5] = -1
    one_problem_naming(validate_shard(corpus), shard(corpus), "dataset 'labels'",
                       "1 label(s) outside [0, 6)", "the first is -1 at frame 5",
                       "utterance 'utt000'")


def test_labels_beyond_the_models_classes(corpus):
    # A held-out corpus is checked against the trained model's outputs.
    problems = validate_shard(corpus, num_classes=2)
    one_problem_naming(problems, shard(corpus), "dataset 'labels'", "outside [0, 2)")


def test_a_rank_reports_only_its_own_part(corpus):
    manifest = load_manifest(corpus)
    plan = split_plan(manifest, 3)
    # The middle rank's first frame in shard 0 or 1.
    first = plan[1][0]
    with ShardReader(manifest.shard_path(first.shard_index)) as reader:
        frame = int(reader.utt_offsets[first.start_utt])
    path = manifest.shard_path(first.shard_index)
    with h5py.File(path, "a") as f:
        f["feats"][frame, 0] = np.nan
    found = [validate_slices(manifest, slices) for slices in plan]
    assert found[0] == [] and found[2] == []
    one_problem_naming(found[1], path, "dataset 'feats'", f"the first at frame {frame}",
                       "(of frames ")


# ---------------------------------------------------------------- layout

@pytest.mark.parametrize("damage,parts", layout_damage_cases())
def test_layout_damage_is_one_line_naming_shard_and_dataset(corpus, damage, parts):
    damage(shard(corpus))
    one_problem_naming(validate_shard(corpus), shard(corpus), *parts)


def test_shard_disagrees_with_the_manifest(corpus):
    def change(data):
        data["shards"][0]["frames"] += 3
        data["shards"][1]["frames"] -= 3
    path = edit_manifest(corpus, change)
    one_problem_naming(validate_shard(corpus), shard(corpus), "dataset 'feats' has",
                       path, "shards[0].frames")


def test_a_held_out_shard_storing_fewer_frames_than_listed_is_named(corpus):
    # The held-out check scans the frames the manifest lists; a shard storing
    # fewer is named, not read past its end.
    def change(data):
        data["shards"][0]["frames"] += 3
        data["shards"][1]["frames"] -= 3
    path = edit_manifest(corpus, change)
    problems = validate_corpus(load_manifest(corpus))
    assert any(shard(corpus) in p and "dataset 'feats' has" in p and "shards[0].frames" in p
               and path in p for p in problems), problems


def test_slice_beyond_the_shards_utterances(corpus):
    manifest = load_manifest(corpus)
    info = manifest.shards[0]
    problems = validate_slices(manifest, [ShardSlice(0, 2, info.utterances + 4, info.frames)])
    one_problem_naming(problems, shard(corpus), "dataset 'utt_offsets'",
                       f"utterances 2:{info.utterances + 4}", f"holds 0:{info.utterances}")


def test_slice_of_a_shard_the_manifest_does_not_list(corpus):
    problems = validate_slices(load_manifest(corpus), [ShardSlice(7, 0, 1, 10)])
    one_problem_naming(problems, "corpus.yaml", "field 'shards'", "shard 7", "lists 2")


# ---------------------------------------------------------------- the file on disk

def test_missing_shard_file(corpus):
    os.remove(shard(corpus, 1))
    one_problem_naming(validate_shard(corpus, 1), shard(corpus, 1), "shard file is missing",
                       "shards[1].path")


def test_a_directory_or_a_pipe_where_a_shard_belongs_is_not_called_missing(corpus):
    os.remove(shard(corpus, 1))
    os.mkdir(shard(corpus, 1))
    one_problem_naming(validate_shard(corpus, 1), shard(corpus, 1),
                       "is a directory, not a shard file", "shards[1].path")
    os.rmdir(shard(corpus, 1))
    os.mkfifo(shard(corpus, 1))
    one_problem_naming(validate_shard(corpus, 1), shard(corpus, 1),
                       "is not a regular file (a named pipe", "shards[1].path")


def test_not_hdf5(corpus):
    overwrite(shard(corpus), 0, b"\0" * 64)
    one_problem_naming(validate_shard(corpus), shard(corpus), "cannot open as HDF5")


def test_truncated_file(corpus):
    with open(shard(corpus), "r+b") as fh:
        fh.truncate(os.path.getsize(shard(corpus)) // 2)
    one_problem_naming(validate_shard(corpus), shard(corpus), "cannot open as HDF5")


def test_damaged_structures_are_named_not_raised(tmp_path):
    # What training reads: the dataset index, the chunk indexes, the names' heap.
    sound = write_corpus(tmp_path / "sound")
    for n, (signature, offset) in enumerate(signature_offsets(shard(sound), (b"TREE", b"HEAP",
                                                                             b"SNOD"))):
        corpus = write_corpus(tmp_path / f"c{n}")
        overwrite(shard(corpus), offset, b"XXXX")
        problems = validate_shard(corpus)
        assert len(problems) >= 1, (signature, offset)
        one_problem_naming(problems, shard(corpus), "the file is damaged")


def test_damaged_label_bytes(corpus):
    overwrite(shard(corpus), first_chunk_offset(shard(corpus), "labels"), b"\xff" * 8)
    one_problem_naming(validate_shard(corpus), shard(corpus), "dataset 'labels'",
                       "2 label(s) outside [0, 6)", "the first is -1 at frame 0")


def test_damaged_feature_bytes(corpus):
    overwrite(shard(corpus), first_chunk_offset(shard(corpus), "feats"), b"\xff" * 4)
    one_problem_naming(validate_shard(corpus), shard(corpus), "dataset 'feats'",
                       "1 frame(s) contain NaN", "frame 0 (utterance 'utt000'")


def test_unreadable_frames(corpus, monkeypatch):
    def fail(self, dest, source_sel=None, dest_sel=None):
        raise OSError("Can't synchronously read data (wrong B-tree signature)")
    monkeypatch.setattr(h5py.Dataset, "read_direct", fail)
    one_problem_naming(validate_shard(corpus), shard(corpus), "dataset 'feats'",
                       "cannot read frames 0:", "the file is damaged")


# ---------------------------------------------------------------- a whole corpus over ranks

def test_corpus_frame_ranges_cover_every_frame_once(tmp_path):
    corpus = write_corpus(tmp_path / "c", num_shards=3, num_utts=10)
    manifest = load_manifest(corpus)
    for size in (1, 2, 5, 40):
        covered = [np.zeros(s.frames, dtype=int) for s in manifest.shards]
        for rank in range(size):
            for index, (first, end) in corpus_frame_ranges(manifest, rank, size).items():
                covered[index][first:end] += 1
        assert all((c == 1).all() for c in covered), size


def test_held_out_nan_is_found_by_exactly_one_rank(corpus):
    with h5py.File(shard(corpus, 1), "a") as f:
        f["feats"][120, 2] = np.nan
    manifest = load_manifest(corpus)
    found = [validate_corpus(manifest, rank=r, size=4, num_classes=NUM_CLASSES)
             for r in range(4)]
    assert sum(bool(p) for p in found) == 1, found
    one_problem_naming(sum(found, []), shard(corpus, 1), "dataset 'feats'",
                       "the first at frame 120")


def test_empty_corpus_is_a_problem_on_every_rank(tmp_path):
    from mpitrain.data.shards import write_shard
    corpus = write_corpus(tmp_path / "c")
    for i in range(2):
        os.remove(shard(corpus, i))
        write_shard(shard(corpus, i), [], [], [], feat_dim=FEAT_DIM)

    def change(data):
        data.update(num_frames=0, num_utterances=0, class_counts=[0] * NUM_CLASSES)
        for entry in data["shards"]:
            entry.update(frames=0, utterances=0)
    path = edit_manifest(corpus, change)
    manifest = load_manifest(corpus)
    for rank in range(3):
        problems = validate_corpus(manifest, rank=rank, size=3)
        assert problems == [f"{path}: field 'num_frames' is 0 (2 shard(s), 0 utterance(s)); "
                            "expected a corpus with at least one frame"]


def test_shard_check_closes_its_file(corpus):
    with ShardCheck(shard(corpus), feat_dim=FEAT_DIM) as check:
        check.scan(0, check.num_frames, num_classes=NUM_CLASSES)
    assert check.problems == []
    # Closed: the file can be opened for writing again.
    with h5py.File(shard(corpus), "a"):
        pass
