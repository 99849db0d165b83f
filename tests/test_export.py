"""Export: a trained model writes Kaldi log-likelihoods that turn back into posteriors."""

import os

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.data.corpus import load_manifest
from mpitrain.nn.model_file import load_model

from .helpers import train_in_process


@pytest.mark.slow
def test_export_writes_kaldi_loglikes(small_corpus, tmp_path):
    import kaldiio
    from mpitrain.data.shards import ShardReader
    run = tmp_path / "run"
    train_in_process(run, small_corpus, ["training.max_steps=30", "model.hidden_dim=32"])
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    with ShardReader(dev.shard_path(0)) as shard:
        feats, _, offsets = shard.read(0, 3)
        ids = shard.utt_ids[:3]
    kaldiio.save_ark(str(tmp_path / "feats.ark"),
                     {u: feats[offsets[i]:offsets[i + 1]] for i, u in enumerate(ids)},
                     scp=str(tmp_path / "feats.scp"))
    out = tmp_path / "loglikes.ark"
    assert main(["export", str(run / "final.h5"), "--feats", f"scp:{tmp_path / 'feats.scp'}",
                 "--out", f"ark:{out}"]) == 0
    loglikes = dict(kaldiio.load_ark(str(out)))
    assert list(loglikes) == list(ids)
    net, priors = load_model(run / "final.h5")
    first = loglikes[ids[0]]
    assert first.shape == (offsets[1] - offsets[0], net.num_classes)
    # adding back the log priors gives log posteriors: each row sums to 1
    post = np.exp(first + np.log(priors)[None, :])
    np.testing.assert_allclose(post.sum(axis=1), 1.0, rtol=1e-4)
