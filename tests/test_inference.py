"""mpitrain.load_model: posteriors and log-likelihoods from Python, as export writes them."""

import kaldiio
import numpy as np
import pytest

import mpitrain
from mpitrain.cli import main

from .data.tiny_models import tiny_model


@pytest.fixture
def model_and_feats(tmp_path):
    path = tiny_model(tmp_path / "model.h5", feat_dim=3, num_classes=5)
    feats = np.random.default_rng(2).normal(size=(11, 3)).astype(np.float32)
    return path, feats


def test_predict_gives_posteriors_and_log_likelihoods_match_export(model_and_feats, tmp_path,
                                                                   capsys):
    path, feats = model_and_feats
    model = mpitrain.load_model(path)
    assert (model.feat_dim, model.num_classes, model.context) == (3, 5, (1, 1))
    post = model.predict(feats)
    assert post.shape == (11, 5) and post.dtype == np.float32
    np.testing.assert_allclose(post.sum(axis=1), 1.0, rtol=1e-5)
    kaldiio.save_ark(str(tmp_path / "f.ark"), {"u": feats})
    assert main(["export", str(path), "--feats", f"ark:{tmp_path}/f.ark",
                 "--out", f"ark:{tmp_path}/ll.ark"]) == 0
    capsys.readouterr()
    exported = dict(kaldiio.load_ark(str(tmp_path / "ll.ark")))["u"]
    np.testing.assert_array_equal(model.log_likelihoods(feats), exported)
    np.testing.assert_allclose(model.log_likelihoods(feats, prior_scale=0.0),
                               np.log(post), atol=1e-5)


def test_bad_features_name_the_model(model_and_feats):
    path, feats = model_and_feats
    model = mpitrain.load_model(path)
    with pytest.raises(ValueError, match=r"model.h5: expected one utterance's features of "
                                         r"shape \(frames, 3\)"):
        model.predict(feats[:, :2])


def test_scoring_utterances_of_many_lengths_does_not_grow_memory(model_and_feats):
    path, _ = model_and_feats
    model = mpitrain.load_model(path)
    rng = np.random.default_rng(0)

    def held():
        return sum(len(c._buffers.keys()) for c in model.net.components
                   if hasattr(c, "_buffers"))
    model.log_posteriors(rng.normal(size=(40, 3)), batch=16)
    before = held()
    for frames in range(1, 60):     # every length a new last-batch size
        model.log_posteriors(rng.normal(size=(frames, 3)), batch=16)
    assert held() == before
