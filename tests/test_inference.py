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


def test_threads_sharing_a_model_get_the_results_of_one(model_and_feats):
    """The network computes in buffers of its own: two threads calling predict at once
    got each other's rows (posteriors off by up to 0.99) or a shape error."""
    import threading
    path, _ = model_and_feats
    model = mpitrain.load_model(path)
    rng = np.random.default_rng(5)
    utterances = [rng.normal(size=(int(n), 3)).astype(np.float32)
                  for n in rng.integers(20, 400, size=30)]
    want = [model.predict(u, batch=64) for u in utterances]
    wrong, errors = [], []

    def work(order):
        try:
            for i in order:
                if not np.array_equal(model.predict(utterances[i], batch=64), want[i]):
                    wrong.append(i)
        except Exception as exc:      # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(list(range(30)) * 3,)),
               threading.Thread(target=work, args=(list(range(29, -1, -1)) * 3,))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and not wrong, (errors[:1], wrong[:5])


def test_features_or_settings_that_would_give_nan_scores_are_refused(model_and_feats):
    # export refuses them; from Python they gave NaN rows without a word
    path, feats = model_and_feats
    model = mpitrain.load_model(path)
    for value in (np.nan, np.inf):
        bad = feats.copy()
        bad[3, 1] = value
        with pytest.raises(ValueError, match=r"model.h5: frame 3 of the features holds NaN, "
                                             r"inf or a value beyond float32"):
            model.predict(bad)
    huge = feats.astype(np.float64)
    huge[4, 0] = 1e300
    with pytest.raises(ValueError, match="frame 4 of the features"):
        model.log_likelihoods(huge)
    for scale in (float("nan"), float("inf"), -1.0, "1"):
        with pytest.raises(ValueError, match="prior_scale: expected a number >= 0"):
            model.log_likelihoods(feats, prior_scale=scale)
    for batch in (None, 0, 2.5, True):
        with pytest.raises(ValueError, match="batch must be an integer >= 1"):
            model.predict(feats, batch=batch)
    np.testing.assert_array_equal(model.log_likelihoods(feats, prior_scale=np.float32(1)),
                                  model.log_likelihoods(feats))


def test_features_that_are_no_array_or_of_another_dtype_name_the_model(model_and_feats):
    # a ragged list raised NumPy's own "inhomogeneous shape" error, naming nothing; a bool
    # or complex array of the right shape was said to be of the wrong shape
    path, feats = model_and_feats
    model = mpitrain.load_model(path)
    with pytest.raises(ValueError, match=r"model.h5: expected one utterance's features of "
                                         r"shape \(frames, 3\), got a list that is not one "
                                         r"rectangular array"):
        model.predict([[0.0, 1.0, 2.0], [0.0, 1.0]])
    for dtype in (bool, np.complex64):
        with pytest.raises(ValueError, match=f"model.h5: expected features of a float or "
                                             f"integer dtype, got {np.dtype(dtype)}"):
            model.predict(feats.astype(dtype))
    with pytest.raises(ValueError, match=r"got float32 \(3,\) \(one frame: feats\[None\]"):
        model.predict(feats[0])
    np.testing.assert_array_equal(model.predict(feats.tolist()), model.predict(feats))
    np.testing.assert_array_equal(model.predict(feats[:1]), model.predict(feats[0][None]))
    # what docs/model-format.md promises: any memory order or float width, no frames
    np.testing.assert_array_equal(model.predict(np.asfortranarray(feats.astype(np.float64))),
                                  model.predict(feats))
    assert model.log_likelihoods(np.zeros((0, 3), np.float16)).shape == (0, 5)


def test_an_utterance_of_no_frames_as_kaldi_writes_it_scores_as_export_scores_it(
        model_and_feats, tmp_path):
    # Kaldi writes it 0 x 0 (kaldiio reads it so): export took it, load_model refused it
    path, _ = model_and_feats
    kaldiio.save_ark(str(tmp_path / "feats.ark"), {"empty": np.zeros((0, 0), np.float32)})
    empty = dict(kaldiio.load_ark(str(tmp_path / "feats.ark")))["empty"]
    model = mpitrain.load_model(path)
    assert model.predict(empty).shape == model.log_likelihoods(empty).shape == (0, 5)
    assert main(["export", str(path), "--feats", f"ark:{tmp_path}/feats.ark",
                 "--out", f"ark:{tmp_path}/out.ark"]) == 0


def test_load_model_names_a_path_of_the_wrong_type(model_and_feats):
    # None reached os.stat ("stat: path should be string, ..."); bytes were shown as b'...'
    path, _ = model_and_feats
    for bad in (None, 3, 1.5):
        with pytest.raises(TypeError, match=r"load_model: path: expected a model file or run "
                                            rf"directory \(str or os.PathLike\), got "
                                            rf"{type(bad).__name__}"):
            mpitrain.load_model(bad)
    assert mpitrain.load_model(str(path).encode()).path == str(path)


def test_a_saturated_sigmoid_scores_without_numpy_warnings(tmp_path):
    # exp(-z) overflowing in a sigmoid gives 0, its exact limit; the scores are finite
    # and right, but NumPy's RuntimeWarning reached the caller of predict
    import warnings
    from mpitrain.nn.affine import Affine
    from mpitrain.nn.model_file import save_model
    from mpitrain.nn.network import Network
    from mpitrain.nn.nonlinear import Sigmoid
    net = Network([Affine(2, 4), Sigmoid(4), Affine(4, 3)], feat_dim=2)
    net.init_params(seed=1)
    save_model(tmp_path / "sig.h5", net, class_priors=np.full(3, 1 / 3))
    model = mpitrain.load_model(tmp_path / "sig.h5")
    feats = np.array([[0.0, 0.0], [1e30, -1e30]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        post = model.predict(feats)
    assert np.isfinite(post).all()
    np.testing.assert_allclose(post.sum(axis=1), 1.0, rtol=1e-5)
