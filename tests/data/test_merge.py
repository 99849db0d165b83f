"""Merging part corpora (one per job-array task) into one corpus directory."""

import os

import numpy as np
import pytest
import yaml

from mpitrain.cli import main
from mpitrain.data.check import check_corpus
from mpitrain.data.corpus import CorpusError, load_manifest
from mpitrain.data.writer import CorpusWriter
from mpitrain.data.merge import merge_corpora, merge_import_reports, pooled_moments
from mpitrain.data.shards import ShardReader

FEAT_DIM = 3


def _utterances(seed, count, num_classes, prefix):
    rng = np.random.default_rng(seed)
    out = []
    for u in range(count):
        frames = int(rng.integers(5, 40))
        feats = (rng.standard_normal((frames, FEAT_DIM)) * (1 + seed) + seed).astype(np.float32)
        labels = rng.integers(0, num_classes, size=frames).astype(np.int32)
        out.append((f"{prefix}-utt{u:03d}", feats, labels))
    return out


def _write_part(directory, utterances, *, num_classes, shards=2):
    with CorpusWriter(str(directory), feat_dim=FEAT_DIM, num_classes=num_classes,
                      num_shards=shards, source={"kind": "test"}) as writer:
        for utt, feats, labels in utterances:
            writer.add(utt, feats, labels)


@pytest.fixture
def two_parts(tmp_path):
    out = tmp_path / "train"
    a = _utterances(1, 12, 7, "spkA")
    b = _utterances(2, 9, 5, "spkB")     # this part never reaches classes 5 and 6
    _write_part(out / "part-00000", a, num_classes=7)
    _write_part(out / "part-00001", b, num_classes=5, shards=1)
    return out, a + b


def test_merged_manifest_matches_statistics_of_all_frames(two_parts):
    out, utterances = two_parts
    merged = merge_corpora(str(out), [out / "part-00000", out / "part-00001"])
    feats = np.concatenate([f for _, f, _ in utterances]).astype(np.float64)
    labels = np.concatenate([lab for _, _, lab in utterances])
    assert merged.num_frames == len(labels)
    assert merged.num_utterances == len(utterances)
    assert merged.num_classes == 7
    assert merged.class_counts == np.bincount(labels, minlength=7).tolist()
    np.testing.assert_allclose(merged.cmvn_mean, feats.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(merged.cmvn_var, feats.var(axis=0), rtol=1e-9)

    reread = load_manifest(str(out))
    assert [s.path for s in reread.shards] == ["part-00000/shard-00000.h5",
                                               "part-00000/shard-00001.h5",
                                               "part-00001/shard-00000.h5"]
    assert check_corpus(str(out)) == []
    ids = []
    for i in range(len(reread.shards)):
        with ShardReader(reread.shard_path(i)) as reader:
            ids += reader.utt_ids
    assert sorted(ids) == sorted(u for u, _, _ in utterances)
    assert [p["path"] for p in reread.source["parts"]] == ["part-00000", "part-00001"]


def test_pooled_moments_of_two_groups():
    mean, var = pooled_moments([100, 300], [[0.0], [1.0]], [[1.0], [1.0]])
    values = np.concatenate([np.r_[np.full(50, -1.0), np.full(50, 1.0)],
                             np.r_[np.full(150, 0.0), np.full(150, 2.0)]])
    assert mean[0] == pytest.approx(values.mean())
    assert var[0] == pytest.approx(values.var())
    with pytest.raises(ValueError, match="frames"):
        pooled_moments([0, 0], [[0.0], [0.0]], [[1.0], [1.0]])


def test_explicit_num_classes_pads_and_rejects_too_few(two_parts):
    out, _ = two_parts
    parts = [out / "part-00000", out / "part-00001"]
    merged = merge_corpora(str(out), parts, num_classes=10)
    assert merged.num_classes == 10 and merged.class_counts[7:] == [0, 0, 0]
    with pytest.raises(CorpusError, match=r"part-00000/corpus.yaml: field 'num_classes'"):
        merge_corpora(str(out), parts, num_classes=6, overwrite=True)


def test_refuses_existing_corpus_without_overwrite(two_parts):
    out, _ = two_parts
    parts = [out / "part-00000", out / "part-00001"]
    merge_corpora(str(out), parts)
    with pytest.raises(CorpusError, match="already exists"):
        merge_corpora(str(out), parts)
    assert merge_corpora(str(out), parts[:1], overwrite=True).num_utterances == 12


def test_part_outside_the_merged_directory_is_refused(tmp_path):
    _write_part(tmp_path / "elsewhere", _utterances(3, 4, 5, "x"), num_classes=5)
    (tmp_path / "train").mkdir()
    with pytest.raises(ValueError, match="subdirectory of the merged corpus"):
        merge_corpora(str(tmp_path / "train"), [tmp_path / "elsewhere"])


def test_a_part_inside_another_part_is_refused(two_parts):
    """A merged corpus and one of its own parts: merged together, that part's shards
    were counted twice, and the corpus written failed `check` ('listed again')."""
    out, _ = two_parts
    _write_part(out / "part-00000" / "inner", _utterances(3, 3, 7, "spkC"), num_classes=7)
    with pytest.raises(ValueError, match=r"part-00000/inner: lies inside .*part-00000, "
                                         r"another part to merge"):
        merge_corpora(str(out), [out / "part-00000", out / "part-00000" / "inner"])
    assert not (out / "corpus.yaml").exists()


def test_duplicate_utterances_and_feat_dim_mismatch_are_named(tmp_path):
    out = tmp_path / "train"
    same = _utterances(4, 3, 5, "dup")
    _write_part(out / "part-00000", same, num_classes=5, shards=1)
    _write_part(out / "part-00001", same, num_classes=5, shards=1)
    with pytest.raises(CorpusError, match=r"part-00001/shard-00000.h5: utterance id 'dup-utt000' "
                                          r"is also in .*part-00000/shard-00000.h5"):
        merge_corpora(str(out), [out / "part-00000", out / "part-00001"])
    assert not os.path.exists(out / "corpus.yaml")

    with CorpusWriter(str(out / "part-00002"), feat_dim=FEAT_DIM + 1, num_classes=5,
                      num_shards=1) as writer:
        writer.add("wide", np.zeros((4, FEAT_DIM + 1), np.float32), np.zeros(4, np.int32))
    with pytest.raises(CorpusError, match=r"part-00002/corpus.yaml: field 'feat_dim': "
                                          r"expected 3"):
        merge_corpora(str(out), [out / "part-00000", out / "part-00002"])


def _report(path, **fields):
    base = {"feats": "scp:x", "ali": "ark:ali.ark", "imported": 0, "frames": 0,
            "missing_alignment": [], "length_mismatch": [], "empty_features": [],
            "alignments_without_features": 0}
    base.update(fields)
    path.mkdir(parents=True, exist_ok=True)
    (path / "import-report.yaml").write_text(yaml.safe_dump(base))


def test_import_reports_count_alignments_no_part_used(tmp_path):
    # 10 alignments; part 0 imported 4 and had 1 too short, part 1 imported 3:
    # 2 alignments had features in neither part.
    _report(tmp_path / "p0", imported=4, frames=40, alignments_without_features=5,
            length_mismatch=[{"utt": "u9", "feat_frames": 3, "ali_frames": 4}])
    _report(tmp_path / "p1", imported=3, frames=30, alignments_without_features=7,
            missing_alignment=["u20"])
    merged = merge_import_reports([tmp_path / "p0", tmp_path / "p1"])
    assert merged["imported"] == 7 and merged["frames"] == 70
    assert merged["alignments_without_features"] == 2
    assert merged["missing_alignment"] == ["u20"] and len(merged["length_mismatch"]) == 1
    assert merge_import_reports([tmp_path / "p0", tmp_path / "nothing"]) is None


def test_merge_command(two_parts, capsys):
    out, utterances = two_parts
    argv = ["merge", str(out), str(out / "part-00000"), str(out / "part-00001")]
    assert main(argv) == 0
    assert f"{len(utterances)} utterances" in capsys.readouterr().out
    assert main(argv) == 2                      # exists: one clear line, exit 2
    assert "already exists" in capsys.readouterr().err
    assert main(argv + ["--overwrite", "--num-classes", "9"]) == 0
    assert load_manifest(str(out)).num_classes == 9


def test_merge_with_no_classes_names_the_option_and_writes_nothing(two_parts, capsys):
    out, _ = two_parts
    assert main(["merge", str(out), str(out / "part-00000"), str(out / "part-00001"),
                 "--num-classes", "0"]) == 2
    assert capsys.readouterr().err == ("mpitrain merge: error: --num-classes (num_classes=): "
                                       "expected a positive int, got 0\n")
    assert not os.path.exists(os.path.join(out, "corpus.yaml"))


def test_merge_command_counts_one_of_each_in_the_singular(tmp_path, capsys):
    # (it said `1 utterances, ... in 1 shards from 1 parts`)
    out = tmp_path / "train"
    _write_part(out / "part-00000", _utterances(1, 1, 3, "spk"), num_classes=3, shards=1)
    assert main(["merge", str(out), str(out / "part-00000")]) == 0
    said = capsys.readouterr().out
    assert f"{out}: 1 utterance, " in said and " frames in 1 shard from 1 part (" in said


def test_a_part_whose_utterance_ids_cannot_be_read_is_named(two_parts, capsys):
    """The heap holding a shard's utterance ids damaged on disk: merge stopped with
    h5py's "Can't synchronously read data (bad global heap collection signature)",
    naming no file."""
    out, _ = two_parts
    path = out / "part-00001" / "shard-00000.h5"
    data = path.read_bytes()
    path.write_bytes(data.replace(b"GCOL", b"XXXX", 1))
    capsys.readouterr()
    assert main(["merge", str(out), str(out / "part-00000"), str(out / "part-00001")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: dataset 'utt_ids' cannot be read (" in err \
        and err.rstrip().endswith("the file is damaged"), err
    assert not (out / "corpus.yaml").exists()


def test_an_overwrite_without_import_reports_leaves_no_report_of_the_corpus_replaced(
        two_parts):
    # (the earlier merge's import-report.yaml stayed beside a corpus.yaml of other parts)
    out, _ = two_parts
    for part, imported in (("part-00000", 12), ("part-00001", 9)):
        _report(out / part, imported=imported)
    merge_corpora(str(out), [out / "part-00000", out / "part-00001"])
    assert yaml.safe_load((out / "import-report.yaml").read_text())["imported"] == 21
    (out / "part-00001" / "import-report.yaml").unlink()
    merge_corpora(str(out), [out / "part-00000", out / "part-00001"], overwrite=True)
    assert not (out / "import-report.yaml").exists()
    assert load_manifest(str(out)).num_utterances == 21
