"""The corpus manifest: class priors, and errors naming the file and the field."""

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


def test_load_manifest_of_a_directory_without_corpus(tmp_path):
    with pytest.raises(CorpusError, match="corpus.yaml: not found"):
        load_manifest(str(tmp_path))
    (tmp_path / "corpus.yaml").write_text("feat_dim: [unclosed\n")
    with pytest.raises(CorpusError, match="corpus.yaml: not valid YAML at line 2"):
        load_manifest(str(tmp_path))
