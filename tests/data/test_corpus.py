"""The corpus manifest: class priors, and errors naming the file and the field."""

import os

import numpy as np
import pytest
import yaml

from mpitrain.data.corpus import CorpusError, load_manifest, manifest_path
from mpitrain.data.writer import CorpusWriter


def test_class_priors_are_floored_and_normalised(tmp_path):
    out = str(tmp_path / "c")
    with CorpusWriter(out, feat_dim=2, num_classes=4, num_shards=1) as writer:
        writer.add("a", np.zeros((6, 2), np.float32), np.array([0, 0, 0, 1, 1, 3]))
    priors = load_manifest(out).class_priors()
    assert priors.shape == (4,) and priors.min() > 0
    np.testing.assert_allclose(priors.sum(), 1.0)
    np.testing.assert_allclose(priors[[0, 1, 3]], np.array([3, 2, 1]) / 6, rtol=1e-6)


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


@pytest.mark.parametrize("second", ["shard-00000.h5", "./shard-00000.h5"])
def test_a_shard_listed_twice_is_refused(tmp_path, second):
    # with totals that add up, it was loaded and trained on twice, by two ranks at once
    out = str(tmp_path / "c")
    with CorpusWriter(out, feat_dim=2, num_classes=3, num_shards=1) as writer:
        writer.add("a", np.zeros((4, 2), np.float32), np.array([0, 1, 2, 2]))
    path = manifest_path(out)
    with open(path) as f:
        data = yaml.safe_load(f)
    data["shards"].append(dict(data["shards"][0], path=second))
    data["num_frames"] *= 2
    data["num_utterances"] *= 2
    data["class_counts"] = [2 * c for c in data["class_counts"]]
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    with pytest.raises(CorpusError) as err:
        load_manifest(out)
    assert str(err.value) == (f"{path}: field 'shards[1].path': {second!r} is listed again "
                              "(shards[0] is the same file); list each shard once")


def test_load_manifest_of_a_directory_without_corpus(tmp_path):
    with pytest.raises(CorpusError, match="corpus.yaml: not found") as info:
        load_manifest(str(tmp_path))
    # a new user's first run names the commands that write one
    assert "`mpitrain synth`, `prepare` or `merge`" in str(info.value)
    (tmp_path / "corpus.yaml").write_text("feat_dim: [unclosed\n")
    with pytest.raises(CorpusError, match="corpus.yaml: not valid YAML at line 2"):
        load_manifest(str(tmp_path))


def test_a_file_named_where_the_corpus_directory_belongs_is_said_so(small_corpus, tmp_path):
    # `eval model.h5 data/dev/corpus.yaml`, or a shard given as data.train
    manifest = f"{small_corpus}/dev/corpus.yaml"
    with pytest.raises(CorpusError) as info:
        load_manifest(manifest)
    assert str(info.value) == (f"{manifest}: is a file, not a corpus directory holding "
                               f"corpus.yaml; name its directory ({small_corpus}/dev)")
    (tmp_path / "shard.h5").write_bytes(b"")
    with pytest.raises(CorpusError) as info:
        load_manifest(str(tmp_path / "shard.h5"))
    assert str(info.value) == (f"{tmp_path / 'shard.h5'}: is a file, not a corpus directory "
                               "holding corpus.yaml")


def test_a_manifest_that_cannot_be_read_is_not_called_missing(tmp_path, monkeypatch):
    import os as os_module
    from mpitrain.data.corpus import CorpusError, read_manifest_data
    real_stat = os_module.stat

    def denied(path, *args, **kwargs):
        if str(path).endswith("corpus.yaml"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os_module, "stat", denied)
    with pytest.raises(CorpusError, match="cannot be read \\(permission denied"):
        read_manifest_data(str(tmp_path / "c" / "corpus.yaml"))
    monkeypatch.setattr(os_module, "stat", real_stat)
    with pytest.raises(CorpusError, match="not found"):
        read_manifest_data(str(tmp_path / "c" / "corpus.yaml"))


def test_a_corpus_directory_that_cannot_be_listed_is_still_said_missing(tmp_path,
                                                                       monkeypatch):
    # a directory one may enter but not list (mode 311): the hint that looks for
    # corpora inside it raised PermissionError, and the not-found line was lost
    import os as os_module
    from mpitrain.data.corpus import read_manifest_data
    (tmp_path / "c").mkdir()

    def unlistable(path="."):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os_module, "listdir", unlistable)
    with pytest.raises(CorpusError) as info:
        read_manifest_data(str(tmp_path / "c" / "corpus.yaml"))
    assert str(info.value).startswith(f"{tmp_path}/c/corpus.yaml: not found; expected a "
                                      f"corpus directory ({tmp_path}/c)"), info.value


def test_check_reports_a_split_it_cannot_read(small_corpus, tmp_path, monkeypatch, capsys):
    import os as os_module
    import shutil
    from mpitrain.cli import main
    corpus = tmp_path / "c"
    shutil.copytree(small_corpus, corpus)
    shutil.move(str(corpus / "train"), str(tmp_path / "away"))
    (corpus / "train").mkdir()
    real_access = os_module.access
    monkeypatch.setattr(os_module, "access", lambda path, mode, *a, **k: False
                        if str(path).endswith("/train") else real_access(path, mode, *a, **k))
    assert main(["check", str(corpus)]) == 1
    captured = capsys.readouterr()
    assert "train/corpus.yaml: not found" in captured.err + captured.out


def test_a_named_pipe_as_the_manifest_is_refused_without_waiting(tmp_path):
    """`mkfifo DIR/corpus.yaml`: check, eval and train waited for a writer forever."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    os.mkfifo(corpus / "corpus.yaml")
    with pytest.raises(CorpusError, match=r"corpus.yaml: not a regular file \(a directory, "
                                          r"named pipe or device\)"):
        load_manifest(str(corpus))
