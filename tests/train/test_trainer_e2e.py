"""End-to-end: the quickstart configuration learns, resumes exactly, exports."""

import json
import os

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.data.corpus import load_manifest
from mpitrain.nn.model_file import load_model

from .conftest import QUICKSTART, small_overrides


def _train(run_dir, corpus, extra=(), resume=False):
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir)]
    for item in small_overrides(corpus) + list(extra):
        argv += ["--set", item]
    if resume:
        argv.append("--resume")
    assert main(argv) == 0


def _records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["type"] == kind]


@pytest.mark.slow
def test_quickstart_learns_far_above_majority_baseline(small_corpus, tmp_path):
    run = tmp_path / "run"
    _train(run, small_corpus, ["training.epochs=4"])
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    majority = counts.max() / counts.sum()          # about 0.03 on this corpus
    final = _records(run, "eval")[-1]
    # 120 classes: chance is 0.008, the majority class about 0.03
    assert majority < 0.06
    assert final["dev_acc"] > 0.45, final
    assert final["dev_acc"] > majority + 0.40
    evals = _records(run, "eval")
    assert evals[-1]["dev_xent"] < evals[0]["dev_xent"]
    # the final model, read back, scores the same held-out accuracy
    assert main(["eval", str(run / "final.h5"), os.path.join(small_corpus, "dev")]) == 0
    assert os.path.exists(run / "config.yaml")


@pytest.mark.parametrize("optimizer,steps", [
    (["optimizer.momentum=0.5"], 60),          # momentum: optimizer state must be restored
    (["optimizer.name=ngsgd"], 40),            # NG-SGD: preconditioner state too
], ids=["sgd-momentum", "ngsgd"])
def test_resume_is_bit_exact(small_corpus, tmp_path, optimizer, steps):
    common = ["training.checkpoint_interval=10", "model.hidden_dim=64", "model.hidden_layers=2",
              "training.epochs=1"] + optimizer
    half = steps // 2
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(straight, small_corpus, common + [f"training.max_steps={steps}"])
    _train(split, small_corpus, common + [f"training.max_steps={half}"])
    _train(split, small_corpus, common + [f"training.max_steps={steps}"], resume=True)
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert np.array_equal(a.params, b.params)
    # and the second run really continued from the midpoint rather than starting over
    assert [r["step"] for r in _records(split, "start")] == [0, half]


def test_checkpoints_are_rotated_and_complete(small_corpus, tmp_path):
    from mpitrain.train.checkpoint import list_checkpoints, load_checkpoint
    run = tmp_path / "run"
    _train(run, small_corpus, ["training.checkpoint_interval=5", "training.keep_checkpoints=2",
                               "training.max_steps=23", "model.hidden_dim=32",
                               "training.plot=true"])
    # training.plot draws the run's curves as a PNG next to the model
    with open(run / "curves.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    found = list_checkpoints(run)
    assert [os.path.basename(p) for p in found] == ["ckpt-00000020.h5", "ckpt-00000023.h5"]
    ckpt = load_checkpoint(found[-1])
    assert ckpt.step == 23 and ckpt.num_ranks == 1
    assert ckpt.rank_state(0)["reader"]["batch_pos"] >= 0
    assert not [f for f in os.listdir(run) if ".tmp" in f]


def test_export_writes_kaldi_loglikes(small_corpus, tmp_path):
    import kaldiio
    from mpitrain.data.shards import ShardReader
    run = tmp_path / "run"
    _train(run, small_corpus, ["training.max_steps=30", "model.hidden_dim=32"])
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
